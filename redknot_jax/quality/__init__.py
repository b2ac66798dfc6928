"""Answer quality of reuse (issue 10): a seeded synthetic multi-document QA task, its
word-level tokenizer, the small DeepSeek-V4-architecture QA model's config, and the training
loop (optax over the project's own modules). `docs/quality.md` reports the results.

* `data`: worlds of made-up people (two-syllable names) with attributes (city, colour, job)
  and one relation (boss); documents of short fact sentences; lookup and two-hop questions;
  train / validation / test splits with disjoint names.
* `model_config`: `qa_config()` (12 layers, sliding / CSA / HCA, hash + learned MoE, 8 heads
  per output group), `qa_profile()` (the reference 3F-6R-3F) and `profile_of(checkpoint)` (the
  profile a checkpoint ships: for the shipped model 5F-4R-3F with half the candidate rows
  protected by latent deviation and their latents recomputed).
* `train`: loss (answer-span cross-entropy + Lightning Indexer KL), optax AdamW step, MoE
  bias balancing, checkpoint writer (hub-layout safetensors + config.json + tokenizer.json).
"""

import pathlib

# The trained QA model shipped with the package (safetensors, config.json, tokenizer.json,
# chat template, RedKnot profile, model card): the server's default model.
SHIPPED_MODEL = pathlib.Path(__file__).resolve().parents[1] / "assets" / "qa_model"
