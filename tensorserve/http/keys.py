"""Typed application state (aiohttp ``AppKey``s)."""

from __future__ import annotations

from aiohttp import web

from tensorserve.metrics import Metrics
from tensorserve.serving.registry import ModelRegistry
from tensorserve.settings import Settings

SETTINGS = web.AppKey("settings", Settings)
REGISTRY = web.AppKey("registry", ModelRegistry)
METRICS = web.AppKey("metrics", Metrics)
