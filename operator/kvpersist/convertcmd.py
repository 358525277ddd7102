"""`kvpersist convert -f FILE`: KVCacheNamespace manifests written for the larger API, in today's form.

The API server prunes the fields that went from stored objects, so the place to convert is where a
manifest is kept (git for Argo CD, a chart's values): this prints each document converted, the
namespace id unchanged (kvpersist.api.convert), and what changed on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    cmd = sub.add_parser("convert", help="print KVCacheNamespace manifests in today's API form (spec.image, "
                         "quantities), the namespace id unchanged", description=__doc__)
    cmd.add_argument("-f", "--filename", required=True, metavar="FILE", help="a YAML file of one or more documents, or -")
    cmd.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from kvpersist.api.convert import ConvertError, convert_object

    text = sys.stdin.read() if args.filename == "-" else Path(args.filename).read_text(encoding="utf-8")
    out: list[Any] = []
    try:
        for index, doc in enumerate(yaml.safe_load_all(text)):
            if doc is None:
                continue
            converted, notes = convert_object(doc) if isinstance(doc, dict) else (doc, [])
            name = (doc.get("metadata") or {}).get("name", f"document {index + 1}") if isinstance(doc, dict) else ""
            for note in notes:
                print(f"kvpersist convert: {name}: {note}", file=sys.stderr)
            out.append(converted)
    except ConvertError as exc:
        print(f"kvpersist convert: {exc}", file=sys.stderr)
        return 2
    except yaml.YAMLError as exc:
        print(f"kvpersist convert: {args.filename} is not YAML: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(yaml.safe_dump_all(out, sort_keys=False, width=1 << 16))
    return 0
