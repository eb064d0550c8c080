"""Add tensorserve's Prometheus adapter rules to an adapter's existing config.

The adapter a cluster runs (kube-prometheus's, in its ConfigMap
``adapter-config``) already serves the resource metrics behind ``kubectl top``
and every CPU/memory HPA; a config holding only tensorserve's rules would
replace those. This keeps every key of the existing ``config.yaml``
(``resourceRules``, ``externalRules``, other ``rules``) and appends
tensorserve's rules from the Helm values snippet
(deploy/kubernetes/prometheus-adapter/values.yaml, ``rules.custom``) to its
``rules`` list. A rule already there that serves the same metric name is
replaced, so running it twice changes nothing.

    python scripts/merge_adapter_rules.py adapter-config.yaml > merged.yaml
    python scripts/merge_adapter_rules.py adapter-config.yaml --patch > patch.json

``--patch`` prints a JSON merge patch of the ConfigMap's ``data.config.yaml``
for ``kubectl patch configmap adapter-config --type merge --patch-file``
(docs/deployment.md), which touches no other key of the ConfigMap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

VALUES = Path(__file__).resolve().parent.parent / "deploy/kubernetes/prometheus-adapter/values.yaml"


def served_name(rule: dict[str, Any]) -> str | None:
    """The metric name a rule serves (``name.as``), its identity here."""
    name = rule.get("name") or {}
    return name.get("as") if isinstance(name, dict) else None


def merge(config: dict[str, Any] | None, ours: list[dict[str, Any]]) -> dict[str, Any]:
    """``config`` with ``ours`` in its ``rules``; everything else untouched."""
    merged = dict(config or {})
    names = {served_name(rule) for rule in ours}
    kept = [rule for rule in merged.get("rules") or [] if served_name(rule) not in names]
    merged["rules"] = kept + list(ours)
    return merged


def our_rules(values: Path = VALUES) -> list[dict[str, Any]]:
    rules = yaml.safe_load(values.read_text())["rules"]["custom"]
    if not rules:
        raise SystemExit(f"{values}: rules.custom is empty")
    return list(rules)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="the adapter's config.yaml as it is now")
    parser.add_argument("--values", type=Path, default=VALUES, help="the rules (rules.custom)")
    parser.add_argument("--patch", action="store_true", help="print a ConfigMap merge patch")
    args = parser.parse_args(argv)
    merged = merge(yaml.safe_load(args.config.read_text()), our_rules(args.values))
    text = yaml.safe_dump(merged, sort_keys=False)
    sys.stdout.write(json.dumps({"data": {"config.yaml": text}}) + "\n" if args.patch else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
