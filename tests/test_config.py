"""ModelConfig: both config.json forms, presets, round trips, and clear errors."""

import dataclasses
import json

import pytest

from redknot_jax import config
from redknot_jax.config import CSA, HCA, SLIDING, ConfigError, ModelConfig


def test_flash_and_pro_schedules():
    f, p = config.flash(), config.pro()
    assert (f.layer_types.count(SLIDING), f.layer_types.count(CSA), f.layer_types.count(HCA)) == (2, 21, 20)
    assert (p.layer_types.count(SLIDING), p.layer_types.count(CSA), p.layer_types.count(HCA)) == (0, 30, 31)
    assert f.layer_types[2] == CSA and p.layer_types[2] == CSA
    assert [f.is_hash(i) for i in range(4)] == [True, True, True, False]


@pytest.mark.parametrize("cfg", [config.flash(), config.pro(), config.flash_shaped(), config.tiny("mixed"),
                                 config.tiny("hca2"), config.tiny("csa")])
def test_round_trip_transformers_form(cfg):
    assert ModelConfig.from_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize("cfg", [config.flash(), config.pro(), config.tiny("mixed")])  # tiny: HCA rate 16
def test_round_trip_hub_form(cfg):
    assert ModelConfig.from_dict(cfg.to_hub_dict()) == cfg


def test_hub_form_takes_any_hca_ratio():
    """DeepSeek's code reads ratio 4 as CSA (overlapping, with an indexer) and any other as HCA:
    the HCA rate is read from compress_ratios; two different ones are refused, named."""
    hub = config.flash().to_hub_dict()
    hub.update(num_hidden_layers=7, num_nextn_predict_layers=0, num_hash_layers=2,
               compress_ratios=[0, 0, 4, 32, 4, 32, 0])
    cfg = ModelConfig.from_dict(hub)
    assert cfg.hca_rate == 32 and cfg.layer_types[3] == HCA and cfg.layer_types[2] == CSA
    with pytest.raises(ConfigError, match=r"two HCA \(non-overlapping\) ratios \[32, 64\]"):
        ModelConfig.from_dict({**hub, "compress_ratios": [0, 0, 4, 32, 4, 64, 0]})
    with pytest.raises(ConfigError, match="HCA rate 16 without an HCA layer"):
        config.tiny("csa").to_hub_dict()


def test_hub_form_as_published_and_transformers_agree():
    """The transformers DeepseekV4Config folds the hub form; our reading of its output matches."""
    from transformers import DeepseekV4Config

    hub = config.flash().to_hub_dict()
    hf = DeepseekV4Config(**hub).to_dict()
    assert ModelConfig.from_dict(hf) == config.flash()


def test_every_field_survives(tmp_path):
    cfg = config.tiny("mixed")
    for f in dataclasses.fields(cfg):
        assert getattr(ModelConfig.from_dict(cfg.to_hf_dict()), f.name) == getattr(cfg, f.name), f.name
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg.to_hf_dict()))
    assert ModelConfig.from_json(p) == cfg


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.update(bogus_field=1), "bogus_field"),
    (lambda d: d.update(num_key_value_heads=2), "num_key_value_heads"),
    (lambda d: d.update(hidden_act="gelu"), "hidden_act"),
    (lambda d: d.update(compress_ratios=[0, 4, 16, 4, 16, 16]), "disagree"),
    (lambda d: d.update(compress_ratios=[0, 4, 128, 4, 16, 4]), "unknown ratios"),
    (lambda d: d.update(num_hash_layers=1), "disagree"),
    (lambda d: d.update(qk_rope_head_dim=4), "disagree"),
    (lambda d: d.pop("layer_types"), "layer_types"),
    (lambda d: d.update(layer_types=["sliding_attention"] * 3), "layer_types"),
    (lambda d: d.update(o_groups=3), "o_groups"),
    (lambda d: d.pop("hidden_size"), "hidden_size"),
])
def test_bad_configs_name_the_field(mutate, needle):
    d = config.tiny("mixed").to_hf_dict()
    mutate(d)
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(d)


def test_bad_json_names_the_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_json(p)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="nope"):
        config.preset("nope")


def test_fingerprint_sensitive():
    assert config.tiny().fingerprint() != config.tiny(index_topk=5).fingerprint()
