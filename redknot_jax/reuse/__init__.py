"""RedKnot reuse runtime (DESIGN.md §2-§6): the pure-data and pure-function pieces.

* `profile`     - `RedKnotProfile`: roles (Global/Local heads), fences, protection sizes,
                  the budget controller rule, the MoE fan-out rule; presets; head-row ceiling.
* `fanout`      - the expert fan-out rule of reusable layers (keep mask over the native top-k).
* `certificate` - artifact certificates, digests, validation -> fallback reason, counters.
* `ledger`      - the four ledgers (head-row, token-row, operator FLOPs, wall-clock), kept apart.

Artifacts, the planner and the RedKnot forward build on these; nothing here touches devices
except `fanout.fanout_keep`, which is jittable.
"""
