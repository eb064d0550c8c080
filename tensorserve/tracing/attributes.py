"""``Attributes``: a span's attributes, as every tracing module types them
(here, below them all, so ``otel.py`` need not import the package that
imports it)."""

from __future__ import annotations

from collections.abc import Mapping

Attributes = Mapping[str, "str | int | float | bool"]
