"""The `deepinfer` command. Each subcommand is a function that adds its parser; bad input ends
in one line `deepinfer: error: ...` and exit status 2, never a traceback (DEEPINFER_DEBUG=1 shows
one)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _user_errors() -> tuple[type, ...]:
    from .ir import ParseError, VerifyError
    from .models.checkpoint import CheckpointError
    from .models.config import ConfigError
    from .models.deepseek_v41 import BuildError

    return (ConfigError, CheckpointError, BuildError, VerifyError, ParseError, FileNotFoundError,
            FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


# ---- inspect ------------------------------------------------------------------------------------

def _fmt_params(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def cmd_inspect(args) -> int:
    """Sizes, cache bytes and op counts of a model, built from its config with no weights."""
    from .models.config import load_config
    from .models.deepseek_v41 import build_model
    from .models.sizes import model_sizes

    cfg = load_config(args.model)
    t = time.perf_counter()
    prog = build_model(cfg)
    build_s = time.perf_counter() - t
    sizes = model_sizes(cfg)
    report = {
        "model": cfg.model_id, "config_hash": cfg.config_hash,
        "params": {k[len("params_"):]: v for k, v in sizes.items() if k.startswith("params_")},
        "bytes_as_shipped": {k[len("bytes_"):]: v for k, v in sizes.items() if k.startswith("bytes_")},
        "global_kv_bytes_per_token": sizes["global_kv_bytes_per_token"],
        "window_ring_bytes_per_sequence": sizes["window_ring_bytes_per_sequence"],
        "checkpoint_tensors": sizes["n_tensors"],
        "graphs": {name: {"nodes": len(g.nodes), "params": len(g.params), "ops": g.op_counts()}
                   for name, g in prog.graphs.items()},
        "state_buffers": len(prog.state),
        "graph_build_seconds": round(build_s, 2),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    p, b = report["params"], report["bytes_as_shipped"]
    print(f"model {cfg.model_id}  (config {cfg.config_hash[:12]})")
    print(f"  parameters  total {_fmt_params(p['total'])}  backbone {_fmt_params(p['backbone'])}  "
          f"Engram {_fmt_params(p['engram'])}  DSpark {_fmt_params(p['dspark'])}  "
          f"activated/decode token {_fmt_params(p['activated'])}")
    print(f"  as shipped  {b['total'] / 1e9:.1f} GB in {report['checkpoint_tensors']} tensors")
    print(f"  KV cache    {report['global_kv_bytes_per_token']:.0f} B/token global, "
          f"{report['window_ring_bytes_per_sequence']} B/sequence of window rings (128-slot)")
    for name, gr in report["graphs"].items():
        top = sorted(gr["ops"].items(), key=lambda kv: -kv[1])[:8]
        print(f"  graph {name:5s} {gr['nodes']} nodes, {gr['params']} params; "
              + ", ".join(f"{k} {v}" for k, v in top))
    print(f"  built in {build_s:.2f} s, {report['state_buffers']} state buffers")
    return 0


def add_inspect(sub):
    p = sub.add_parser("inspect", help="sizes, KV bytes and op counts of a model (no weights needed)")
    p.add_argument("--model", required=True, help="preset name (v4.1-flash, v4.1-flash-medium, "
                   "v4.1-flash-tiny) or a directory holding config.json")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_inspect)


# ---- make-checkpoint ----------------------------------------------------------------------------

def cmd_make_checkpoint(args) -> int:
    from .models.checkpoint import checkpoint_bytes, make_checkpoint
    from .models.config import load_config

    cfg = load_config(args.model)
    t = time.perf_counter()
    out = make_checkpoint(cfg, args.output, seed=args.seed, overwrite=args.overwrite, force=args.force)
    print(f"wrote {out} ({checkpoint_bytes(cfg) / 1e6:.1f} MB, seed {args.seed}) in {time.perf_counter() - t:.1f} s")
    return 0


def add_make_checkpoint(sub):
    p = sub.add_parser("make-checkpoint", help="write a random checkpoint in the real format (deterministic per seed)")
    p.add_argument("--model", required=True, help="preset name or a directory holding config.json")
    p.add_argument("-o", "--output", required=True, help="checkpoint directory to create")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint directory")
    p.add_argument("--force", action="store_true", help="allow a checkpoint larger than the size guard")
    p.set_defaults(func=cmd_make_checkpoint)


COMMANDS = [add_inspect, add_make_checkpoint]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer", description="DeepInfer: compile a model graph into a plan of generated kernels and run it.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except _user_errors() as e:
        if os.environ.get("DEEPINFER_DEBUG"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, OSError) and e.filename:
            msg = f"{e.strerror}: {e.filename}"
        print(f"deepinfer: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("deepinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
