"""Asks a vLLM installation's own `vllm serve` parser what it does with option strings; run by the
oracle test in each vLLM it knows (0.33.0 in the test venv, the 0.32.0 CPU build in its own).

stdin: {"baseline": [serve args], "probes": [[extra args], ...]}
stdout: {"version", "options": {spelling: dest} for every spelling the parser resolves (long and
short options, every unambiguous abbreviation of a long one), "full": [the option strings
themselves], "probes": [{"error": str} or {"changed": [dests whose value differs from the
baseline]}]}
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys


def shown(value: object) -> str:
    """A parsed value by its fields: configs (e.g. KVTransferConfig) compare by identity, and a
    KVTransferConfig draws a fresh random engine_id each time it is parsed."""
    return re.sub(r"engine_id='[^']*'", "engine_id=*", repr(value))


def main() -> None:
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms._current_platform = CpuPlatform()  # no GPU here: the parser needs a platform
    from importlib.metadata import version

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    request = json.load(sys.stdin)
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))

    options: dict[str, str] = {}
    for action in serve._actions:
        for spelling in action.option_strings:
            options[spelling] = action.dest
            if spelling.startswith("--") and serve.allow_abbrev:
                for end in range(3, len(spelling)):
                    prefix = spelling[:end]
                    if prefix in options:
                        continue
                    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(SystemExit):
                        found = serve._parse_optional(prefix)  # argparse's own abbreviation lookup
                        if found and found[0] is not None:
                            options[prefix] = found[0].dest

    def parse(args: list[str]) -> dict:
        with contextlib.redirect_stderr(io.StringIO()):
            return vars(parser.parse_args(args))

    base = parse(request["baseline"])
    probes = []
    for extra in request["probes"]:
        try:
            got = parse(request["baseline"] + extra)
        except SystemExit:
            probes.append({"error": "refused by vLLM's parser"})
            continue
        probes.append({"changed": sorted(k for k in set(base) | set(got) if shown(base.get(k)) != shown(got.get(k)))})
    full = sorted(s for a in serve._actions for s in a.option_strings)
    json.dump({"version": version("vllm"), "options": options, "full": full, "probes": probes}, sys.stdout)


if __name__ == "__main__":
    main()
