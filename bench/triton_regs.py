"""Registers and spills of a Triton template's kernels per config, as a plan builds them here (Triton
ahead of time, this host's ptxas), on the instances a compile of the model would make.

`bench/kernels_triton.py` times the device's own Triton (JIT), which allocates registers its own
way: the prefill mix split on 64-row blocks, 32 deep, ran 1.6x faster there than the shipped
16-row config, yet the plan's build of it spills 884 times and its prefill step was slower (docs/
performance.md, thirty-fourth session). Read the plan's registers here before a device A/B:

    python bench/triton_regs.py triton_hc_mix --prefill 4096 \\
        --configs '[{}, {"BM": 64, "BK": 8}, {"BM": 128, "BK": 8, "num_warps": 8}]'

Each config is laid over the instance's own (the target's default); one line per instance and
config: the template's kernels' registers, spill instructions and shared bytes.
"""
import argparse
import json
import sys
import time

from deepinfer.codegen.build import build_one
from deepinfer.codegen.targets import get_target
from deepinfer.codegen.template import templates
from deepinfer.passes.driver import CompileOptions, select_instances


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("template", help="a Triton template's name, e.g. triton_hc_mix")
    p.add_argument("--model", default="v4.1-flash-medium")
    p.add_argument("--target", default="sm90")
    p.add_argument("--decode", default="1", help="decode buckets of the compile (comma list)")
    p.add_argument("--prefill", default="4096", help="prefill buckets of the compile (comma list)")
    p.add_argument("--spec", default="", help="only instances whose spec text contains this")
    p.add_argument("--configs", default="[{}]", help="JSON list of configs laid over each instance's own")
    a = p.parse_args(argv)
    tpl = templates().get(a.template)
    if tpl is None or not a.template.startswith("triton_"):
        print(f"triton_regs: {a.template!r} is not a Triton template", file=sys.stderr)
        return 2
    target = get_target(a.target)
    opts = CompileOptions(target=a.target, tuning_db="none",
                          decode_batches=tuple(int(b) for b in a.decode.split(",") if b),
                          prefill_tokens=tuple(int(t) for t in a.prefill.split(",") if t))
    overs = json.loads(a.configs)
    for name, spec, own in ((v[1], v[2], json.loads(k)[2]) for k, v in select_instances(a.model, opts).items()):
        if name != a.template or a.spec not in str(spec):
            continue
        print(f"{spec.op} {[str(t) for t in spec.in_types]}  own {json.dumps(own, sort_keys=True)}", flush=True)
        for over in overs:
            t0 = time.time()
            res = build_one(tpl.render(target, spec, dict(own, **over)), target)
            kernels = "; ".join(f"{k.split(':', 1)[1]} {r.get('n_regs')} regs {r.get('n_spills')} spills "
                                f"{r.get('shared_bytes')} B" for k, r in res.resources.items()) \
                if res.status == "built" else f"{res.status}: {res.reason}"
            print(f"  {json.dumps(over, sort_keys=True):48s} {kernels}  ({time.time() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
