"""The kernel coverage table of docs/kernels.md: for every op of the real model (and the medium
plan that runs on the H200), the templates that serve its instances on each target, read off the
compiler's kernel selection (nothing rendered or built). `--write` replaces the table between its
markers in docs/kernels.md."""
import argparse
import sys
from pathlib import Path

from deepinfer.atomic import replace_file
from deepinfer.passes.coverage import coverage_table, templates_per_op
from deepinfer.passes.driver import CompileOptions, select_instances

BEGIN, END = "<!-- kernel-coverage:begin -->", "<!-- kernel-coverage:end -->"
MEDIUM = dict(max_num_seqs=64, max_model_len=8192, decode_batches=(1, 8, 64), prefill_tokens=(4096,))
COLUMNS = {  # heading -> (model, target, options): what each column's plan is and where it has run
    "sm90, medium plan (ran on the H200, every call checked against its op's reference)":
        ("v4.1-flash-medium", "sm90", MEDIUM),
    "sm90, real model (built here; not run: 510 GB)": ("v4.1-flash", "sm90", {}),
    "sm100, real model (built here, never run)": ("v4.1-flash", "sm100", {}),
    "ascend950, real model (rendered and capacity-checked here, never built or run)": ("v4.1-flash", "ascend950", {}),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--write", action="store_true", help="replace the table in docs/kernels.md")
    args = ap.parse_args(argv)
    cols = {head: templates_per_op(select_instances(model, CompileOptions(target, tuning_db="none", **opts)))
            for head, (model, target, opts) in COLUMNS.items()}
    table = coverage_table(cols)
    if not args.write:
        print(table)
        return 0
    doc = Path(__file__).resolve().parent.parent / "docs" / "kernels.md"
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        print(f"{doc}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    replace_file(doc, (head + BEGIN + "\n" + table + "\n" + END + rest.split(END, 1)[1]).encode())
    print(f"{doc}: table of {len(table.splitlines()) - 2} ops written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
