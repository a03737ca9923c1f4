"""The ``comera`` command: dump contraction plans, print a layer summary, run the demo."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from comera_compile import __version__
from comera_compile.cli.model_specs import BUILTIN
from comera_compile.passes.choose import AUTO
from comera_compile.passes.specs import LINEAR_FORMATS

DESCRIPTION = """\
Compress a PyTorch model into tensor-train (TT/TTM) layers and inspect the result.

  comera demo                              train a small transformer dense and compressed
  comera summary six-encoder --budget 5%   per-layer formats, ranks, parameters, MACs
  comera plans mymodels:make_model --batch-sizes 1,32 --json plans.json

A model SPEC is a built-in name or module:factory, where factory() returns a model or
(model, example_inputs); the module is looked up from the current directory first,
as `python -m` does."""

FORMAT_CHOICES = (*LINEAR_FORMATS, AUTO)

BUDGET_FORMS = (
    "a parameter count (100000), a fraction of the parameters to keep (0.05 or 5%), "
    "a compression ratio (40x), or a size in bytes (20MB, 512KiB)"
)


class _Parser(argparse.ArgumentParser):
    """Prints ``comera: error: ...`` for subcommands too (argparse would print their prog)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(2, f"comera: error: {message}\n")


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default and keeps the description's line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if isinstance(action, argparse._StoreTrueAction) or action.default is None:
            return action.help or ""  # "(default: False)" or "(default: None)" is noise
        return super()._get_help_string(action)


def parse_budget_arg(text: str):
    """``100000`` -> params, ``0.05`` / ``5%`` -> fraction, ``40x`` -> ratio, ``20MB`` -> bytes."""
    from comera_compile.passes.budget import parse_budget

    cleaned = text.strip().replace("_", "")
    value: int | float | str = cleaned
    try:
        value = int(cleaned)
    except ValueError:
        try:
            value = float(cleaned)
        except ValueError:
            pass
    if isinstance(value, float) and value > 1 and value.is_integer():
        value = int(value)  # 1e5 is a parameter count
    if isinstance(value, float) and not 0 < value <= 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a whole parameter count nor a fraction in (0, 1]; "
            f"give {BUDGET_FORMS}"
        )
    try:
        parse_budget(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"cannot read budget {text!r}; give {BUDGET_FORMS}"
        ) from None
    return value


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers such as 1,32,4096, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive, got {text!r}")
    return sizes


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def check_output_file(path: str) -> None:
    """Fail before the work if ``path`` cannot be written: a missing folder, or a folder."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"--json {path} is a directory; give a file name such as plans.json")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"--json {path}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--json {path}: the folder {parent} is not writable")


def check_output_dir(path: str) -> None:
    """Fail before the work if ``path`` is a file or sits under one (it may not exist yet)."""
    target = Path(path)
    for folder in (target, *target.parents):
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"--out {path}: {folder} is a file, not a folder; give a folder")
        if folder.is_dir():
            if not os.access(folder, os.W_OK):
                raise ValueError(f"--out {path}: {folder} is not writable")
            return


def _tensorized(spec: str, budget, layer_format: str | None = None):
    """The model ``spec`` names, optimized under ``budget`` (in ``layer_format``; None: the
    default) unless it is tensorized already."""
    from comera_compile.api import optimize
    from comera_compile.cli.model_specs import load_spec
    from comera_compile.nn import tensorized_layers

    cwd = os.getcwd()
    if ":" in spec and cwd not in sys.path and "" not in sys.path:
        # `comera summary mymodels:make` finds ./mymodels.py; appended, so a file of the
        # folder never shadows a module the tools import (a getpass.py, a json.py)
        sys.path.append(cwd)
    loaded = load_spec(spec)
    if tensorized_layers(loaded.model):
        return loaded.model
    return optimize(loaded.model, budget, format=layer_format,
                    example_inputs=loaded.example_inputs or None, compile=False)


def _cmd_plans(args: argparse.Namespace) -> None:
    from comera_compile.api import plans

    if args.json:
        check_output_file(args.json)
    report = plans(_tensorized(args.spec, args.budget, args.format), batch_sizes=args.batch_sizes)
    print(report)
    if args.json:
        report.to_json(args.json)
        print(f"\nwrote {len(report)} plan records to {args.json}")


def _cmd_summary(args: argparse.Namespace) -> None:
    from comera_compile.api import summary

    print(summary(_tensorized(args.spec, args.budget, args.format)))


def _cmd_demo(args: argparse.Namespace) -> None:
    check_output_dir(args.out)
    from comera_compile.cli.demo import run_demo

    run_demo(steps=args.steps, out=args.out, seed=args.seed, threads=args.threads,
             progress=not args.quiet)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="comera", description=DESCRIPTION, formatter_class=_Help)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    spec_help = f"a built-in model ({', '.join(sorted(BUILTIN))}) or module:factory"
    budget_help = f"size limit if SPEC is not tensorized yet: {BUDGET_FORMS}".replace("%", "%%")
    format_help = ("layer format if SPEC is not tensorized yet (default: cola from scratch, "
                   "as optimize's format=None)")

    p = sub.add_parser("plans", help="the contraction plan of every tensorized layer",
                       description="Print the contraction order each tensorized layer runs at "
                       "each batch size\n(rows), with its cost.", formatter_class=_Help)
    p.add_argument("spec", metavar="SPEC", help=spec_help)
    p.add_argument("--batch-sizes", metavar="N,N,...", type=_batch_sizes, default="1,32,4096",
                   help="comma-separated numbers of rows to plan for")
    p.add_argument("--json", metavar="FILE", help="also write the records as JSON to FILE")
    p.add_argument("--budget", type=parse_budget_arg, default="0.05", help=budget_help)
    p.add_argument("--format", choices=FORMAT_CHOICES, default=None, help=format_help)
    p.set_defaults(func=_cmd_plans)

    p = sub.add_parser("summary", help="per-layer formats, modes, ranks, parameters, MACs",
                       description="Optimize SPEC (unless it is tensorized already) and print "
                       "one row per layer.", formatter_class=_Help)
    p.add_argument("spec", metavar="SPEC", help=spec_help)
    p.add_argument("--budget", type=parse_budget_arg, default="0.05", help=budget_help)
    p.add_argument("--format", choices=FORMAT_CHOICES, default=None, help=format_help)
    p.set_defaults(func=_cmd_summary)

    p = sub.add_parser("demo", help="train a small transformer dense and compressed, compare",
                       description="Train a 2-layer transformer classifier on a synthetic "
                       "sentence-pair task twice,\ndense and with CoMERA, and compare accuracy, "
                       "size and step time.", formatter_class=_Help)
    p.add_argument("--steps", type=_positive_int, default=1000,
                   help="training steps for each of the two models (at least 10)")
    p.add_argument("--out", metavar="DIR", default="runs/demo",
                   help="folder for the rank history (CSV), rank plot and plans (JSON)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed for the weights and the data; the same seed gives the same run")
    p.add_argument("--threads", type=_positive_int, default=1,
                   help="CPU threads; fixed so that the numbers reproduce")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (2 for any bad input, with the fix named)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version, or an argument error already printed
        return int(done.code or 0)
    try:
        args.func(args)
    except (ValueError, TypeError, OSError, ImportError) as err:
        print(f"comera: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
