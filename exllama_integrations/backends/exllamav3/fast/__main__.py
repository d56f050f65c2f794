"""``python -m exllama_integrations.backends.exllamav3.fast [--record]``: what the package relies on, checked.

Prints what the installed exllamav3 (or ``--root``) does not meet of the fast path's requirements
(:data:`.requirements.REQUIREMENTS`; :data:`.requirements.PINNED`, its pinned strategy's) and of the rest of the
backend's (:data:`..upstream.requirements.REQUIREMENTS`), and what changed since each verified release's recorded facts;
``--record`` writes the installed release's facts to ``upstream/recorded/`` (the step of docs/exllamav3-releases.md
that adds a release to the verified set).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..upstream import depends
from ..upstream import requirements as backend
from . import requirements


def main() -> None:
    """Print the check against the installed exllamav3; ``--record``: write its facts to ``upstream/recorded/``."""
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
    checked = {
        "the fast path": requirements.REQUIREMENTS,
        "the pinned strategy of deterministic=True": requirements.PINNED,
        "the backend": backend.REQUIREMENTS,
    }
    found = depends.facts(root, [r for reqs in checked.values() for r in reqs])
    for user, reqs in checked.items():
        unmet = depends.problems(reqs, found)
        log.info("%s: %s", user, f"{len(unmet)} unmet" if unmet else f"every requirement met ({len(reqs)})")
        for line in unmet:
            log.info("  %s", line)
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
