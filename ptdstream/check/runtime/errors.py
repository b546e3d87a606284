"""The error of a runtime rule: a load the runtime would refuse, named by the upstream
function that refuses it (verify turns it into a problem line; it never reaches users)."""

from __future__ import annotations

__all__ = ["RuleError"]


class RuleError(Exception):
    """A load the runtime would refuse. ``rule`` names the upstream function."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"{detail} [{rule}]")
        self.rule, self.detail = rule, detail
