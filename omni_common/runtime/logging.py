"""Logging set-up shared by every process: one line per record, service name first."""

from __future__ import annotations

import logging
import os


def setup_logging(service: str) -> logging.Logger:
    level = os.environ.get("OMNISTAGE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
    return logging.getLogger(f"omnistage.{service}")
