"""A call's search space: its template's knobs (codegen/template.py `Template.knobs`: tiles,
stages, warps or threads, splits and the template's own), rendered one config at a time and
pruned by static legality before anything is built: a config the template cannot render, or
whose render the target's capacity check refuses (threads per block, shared memory on NVIDIA;
buffer capacities, 32-byte alignment and AI cores on Ascend: codegen/targets/capacity.py), never
reaches a build. Registers are checked after a build, from the ptxas report (the same check with
the build's resources)."""
from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Candidate:
    config: dict
    source: object  # the rendered KernelSource


def sample_configs(target, template, spec, limit: int = 64, seed: int = 0) -> tuple[list[dict], int]:
    """The distinct points of `template`'s space for `spec` (the default first), at most `limit`
    of them (a seeded sample of larger spaces), and the size of the whole space."""
    default = dict(template.default_config(target, spec))
    points = [dict(default, **c) for c in template.configs(target, spec)]
    unique, seen = [], set()
    for c in [default] + points:
        key = tuple(sorted(c.items()))
        if key not in seen:
            seen.add(key)
            unique.append(c)
    space = len(unique)
    if len(unique) > limit:
        rest = random.Random(seed).sample(unique[1:], limit - 1)
        unique = [unique[0]] + rest
    return unique, space


def illegal(manifest, source) -> bool:
    """A render the target's capacity check refuses (None: the config did not render)."""
    return source is None or bool(manifest.check and manifest.check(source, None))


def candidates(manifest, template, spec, limit: int = 64, seed: int = 0,
               render_all=None) -> tuple[list[Candidate], int]:
    """The legal configs of `template` for `spec` (the default first), at most `limit` of them (a
    seeded sample of larger spaces), and how many the legality checks pruned. `render_all(configs)`
    renders them all at once (a source or None each: the tuner's goes through the render cache);
    without it each renders here."""
    configs, _ = sample_configs(manifest.target, template, spec, limit, seed)
    if render_all is not None:
        sources = render_all(configs)
    else:
        sources = []
        for cfg in configs:
            try:
                sources.append(template.render(manifest.target, spec, cfg))
            except Exception:  # noqa: BLE001  (a config the template cannot render is not legal)
                sources.append(None)
    out, pruned = [], 0
    for cfg, src in zip(configs, sources):
        if illegal(manifest, src):
            pruned += 1
            continue
        out.append(Candidate(cfg, src))
    return out, pruned
