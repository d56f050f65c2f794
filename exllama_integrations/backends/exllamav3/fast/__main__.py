"""``python -m exllama_integrations.backends.exllamav3.fast [--record]``: the seam's requirements checked.

Prints what of :data:`.requirements.REQUIREMENTS` the installed exllamav3 (or ``--root``) does not meet, and what
changed since each verified release's recorded facts; ``--record`` writes the installed release's facts to
``recorded/`` (the step of docs/exllamav3-releases.md that adds a release to the verified set).
"""

from __future__ import annotations

import json
from pathlib import Path

from . import depends, requirements


def main() -> None:
    """Print the seam's check against the installed exllamav3; ``--record``: write its facts to ``recorded/``."""
    import argparse
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("depends")
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--root", type=Path, default=None, help="an exllamav3 source folder (default: the installed one)")
    ap.add_argument("--version", default=None, help="its version (default: the installed one)")
    args = ap.parse_args()
    root = args.root or depends.source_root("exllamav3")
    version = args.version or depends.installed_version("exllamav3")
    if root is None or version is None:
        raise SystemExit("exllamav3 is not installed (give --root and --version)")
    found = depends.facts(root, requirements.REQUIREMENTS)
    for line in depends.problems(requirements.REQUIREMENTS, found) or ["every requirement met"]:
        log.info("%s", line)
    for verified in sorted(requirements.VERIFIED):
        base = depends.recorded(".".join(map(str, verified)))
        if base is not None:
            diff = depends.changed(base["facts"], found)
            log.info(
                "against the verified %s: %s", base["exllamav3"], f"{len(diff)} changed: {diff}" if diff else "the same"
            )
    if args.record:
        rel = ".".join(map(str, depends.release(version) or ()))
        depends.RECORDED.mkdir(exist_ok=True)
        path = depends.RECORDED / f"exllamav3-{rel}.json"
        path.write_text(json.dumps({"exllamav3": rel, "facts": found}, indent=1, sort_keys=True) + "\n")
        log.info("recorded %d facts of exllamav3 %s in %s", len(found), rel, path)


main()
