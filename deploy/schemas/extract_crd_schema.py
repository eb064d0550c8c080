"""Extract one version's OpenAPI v3 schema from a CustomResourceDefinition.

    python deploy/schemas/extract_crd_schema.py CRD.yaml VERSION OUT.json

Writes the ``spec.versions[name == VERSION].schema.openAPIV3Schema`` of the
CRD as JSON with every ``description`` removed (they are most of the bytes
and none of the validation), plus the CRD's group, kind and version, so
that ``tests/test_deploy_manifests.py`` can validate our resources with
``jsonschema``. deploy/schemas/README.md lists where each file came from.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        # A *property* called "description" (a field of the resource) stays;
        # only the annotation keyword goes.
        return {
            key: (strip_descriptions(value) if key != "properties" else
                  {name: strip_descriptions(sub) for name, sub in value.items()})
            for key, value in node.items()
            if key != "description" or not isinstance(value, str)
        }
    if isinstance(node, list):
        return [strip_descriptions(entry) for entry in node]
    return node


def extract(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return {
                "group": crd["spec"]["group"],
                "kind": crd["spec"]["names"]["kind"],
                "version": version,
                "openAPIV3Schema": strip_descriptions(entry["schema"]["openAPIV3Schema"]),
            }
    raise SystemExit(f"{crd['metadata']['name']} has no version {version!r}")


def main() -> None:
    source, version, out = sys.argv[1:4]
    crd = yaml.safe_load(Path(source).read_text())
    Path(out).write_text(json.dumps(extract(crd, version), sort_keys=True, separators=(",", ":")))


if __name__ == "__main__":
    main()
