"""``tandem validate FILE``: checks a topology file without starting anything.

A good file is printed back normalised, every default filled in (warnings go to stderr), and
the command exits 0. A bad one gets every mistake on stderr, one ``FILE:LINE: key: message``
line each, and exit status 1. It checks what ``tandem up`` of the file on this machine would
fail on, the model included (its path must exist here unless ``--model-elsewhere``).
"""

from __future__ import annotations

import argparse
import sys

from cluster.topology import validate_file


def add_validate_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "validate",
        help="check a topology YAML file and print it with every default filled in",
        description="Check a topology YAML file: every mistake is reported with its line. "
                    "A valid file is printed back normalised, every default filled in.",
    )
    parser.add_argument("file", help="the topology YAML file")
    parser.add_argument("--model-elsewhere", action="store_true",
                        help="model.path is on the machines that will run the cluster, not here: a missing one is "
                             "a warning, not an error")
    parser.set_defaults(func=cmd_validate)
    return parser


def cmd_validate(args: argparse.Namespace) -> int:
    spec, errors, warnings = validate_file(args.file, model_elsewhere=args.model_elsewhere)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if errors:
        for error in errors:
            print(error.format(args.file), file=sys.stderr)
        return 1
    sys.stdout.write(spec.to_yaml())
    return 0
