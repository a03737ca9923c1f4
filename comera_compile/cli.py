"""The ``comera`` command: dump contraction plans, print a layer summary, run the demo.

    comera plans SPEC --batch-sizes 1,32,4096 [--json FILE] [--budget B]
    comera summary SPEC [--budget 0.05]
    comera demo [--steps N] [--out DIR]

SPEC is a built-in model (``comera_compile.specs.BUILTIN``) or ``package.module:factory``.
A model that has no tensorized layer yet is optimized under ``--budget`` first.
"""

from __future__ import annotations

import argparse
import sys

from comera_compile.specs import BUILTIN


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def _budget(text: str):
    """A float fraction stays a float; anything else (``"20MB"``) goes to Budget parsing."""
    try:
        return float(text)
    except ValueError:
        return text


def _tensorized(spec: str, budget):
    from comera_compile.api import optimize
    from comera_compile.nn import tensorized_layers
    from comera_compile.specs import load_spec

    loaded = load_spec(spec)
    if tensorized_layers(loaded.model):
        return loaded.model
    return optimize(
        loaded.model,
        budget,
        example_inputs=loaded.example_inputs or None,
        compile=False,
    )


def _cmd_plans(args: argparse.Namespace) -> None:
    from comera_compile.api import plans

    report = plans(_tensorized(args.spec, args.budget), batch_sizes=args.batch_sizes)
    print(report)
    if args.json:
        report.to_json(args.json)
        print(f"\nwrote {len(report)} plan records to {args.json}")


def _cmd_summary(args: argparse.Namespace) -> None:
    from comera_compile.api import summary

    print(summary(_tensorized(args.spec, args.budget)))


def _cmd_demo(args: argparse.Namespace) -> None:
    from comera_compile.demo import run_demo

    run_demo(steps=args.steps, out=args.out, seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="comera", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    spec_help = f"built-in model ({', '.join(sorted(BUILTIN))}) or package.module:factory"

    p = sub.add_parser("plans", help="dump the contraction plan of every tensorized layer")
    p.add_argument("spec", help=spec_help)
    p.add_argument("--batch-sizes", type=_batch_sizes, default=[1, 32, 4096])
    p.add_argument("--json", help="also write the records as JSON to this file")
    p.add_argument("--budget", type=_budget, default=0.05, help="used if SPEC is dense")
    p.set_defaults(func=_cmd_plans)

    p = sub.add_parser("summary", help="per-layer formats, modes, ranks, parameters, MACs")
    p.add_argument("spec", help=spec_help)
    p.add_argument("--budget", type=_budget, default=0.05)
    p.set_defaults(func=_cmd_summary)

    p = sub.add_parser("demo", help="optimize and train a transformer, compare with dense")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", default="runs/demo", help="where the rank plot and CSV go")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError) as err:
        print(f"comera: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
