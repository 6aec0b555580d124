"""Argument types of the command: each refuses a bad value with a one-line reason."""

from __future__ import annotations

import argparse
from typing import NoReturn

from taproute.service.host.cli.errors import BAD_INPUT


def letter_id(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"dead letter ids are in [1, 2**63 - 1], got {text}")
    return value


def int64(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be a 64-bit integer, got {text}")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in [0, 65535], got {text}")
    return value


def count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= value <= 10**9:
        raise argparse.ArgumentTypeError(f"must be in [1, 1e9], got {text}")
    return value


def token(text: str) -> str:
    if not text or not text.isascii() or not text.isprintable() or " " in text:
        raise argparse.ArgumentTypeError("a token is printable ASCII without spaces")
    return text


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 86_400:
        raise argparse.ArgumentTypeError(f"must be in [0, 86400] seconds, got {text}")
    return value


def rate(text: str) -> float:
    """Records per second: a finite number above 0 (at most a billion)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1e9:
        raise argparse.ArgumentTypeError(f"must be in (0, 1e9] records per second, got {text}")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (``taproute dead-letters: error: ...``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")
