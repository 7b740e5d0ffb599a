"""Reading untrusted config mappings field by field, collecting every problem as one line.

Each problem names its path (`recipes[1].gpu`) and says how to fix it. Readers never raise on bad
input: they record the problem and return a placeholder, so one pass reports everything at once.
"""

import difflib
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

from denv_iac.core.stack.model import Secret
from denv_iac.core.stack.values import (
    DEPLOY_ENV,
    ENV_NAME,
    ENV_RULE,
    control_character,
    describe_character,
)

NAME_PATTERN = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")
NAME_RULE = (
    "use 1-40 lower-case letters, digits and '-', starting and ending with a letter or digit"
)


class Problems:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.lines.append(f"{path}: {message}")

    def __bool__(self) -> bool:
        return bool(self.lines)


def describe(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} (not a finite number)"
    if isinstance(value, int) and not fits_float(value):
        return "a number too large to compute with"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string" if value.strip() else "an empty string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "empty" if value is None else type(value).__name__


def finite(value: object) -> TypeGuard[int | float]:
    """A number that is no boolean, .nan or .inf: YAML's .nan and .inf would print as
    "$nan/hour" and write NaN into JSON. An integer is one at any size (YAML reads 10**400 as
    one, where math.isfinite would raise)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def fits_float(value: int | float) -> bool:
    """Whether a number converts to a float: an integer past 1.8e308 does not (OverflowError)."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _writable_number(value: object) -> bool:
    """A number an env value may be, written as text: finite, and of a size Python writes (it
    will not write an integer of over 4300 digits, which a hexadecimal YAML value can hold)."""
    return finite(value) and fits_float(value)


def shown_number(number: int) -> str:
    """A whole number as a message shows it: in digits while that stays short (Python will not
    even write one of over 4300 digits, which a hexadecimal YAML value can hold)."""
    return str(number) if abs(number) < 10**30 else "a number this large"


def is_secret(value: object) -> bool:
    return isinstance(value, dict) and set(value) == {"secure"} and isinstance(value["secure"], str)


# How a secret field is set: the `how` of most Fields.secret calls.
SECRET_HOW = "set it with 'pulumi config set --secret' (see docs/stacks.md)"
EMPTY_SECRET = "secure: is empty, a secret of nothing; set it with 'pulumi config set --secret'"


def is_empty_secret(value: object) -> bool:
    return is_secret(value) and not value["secure"].strip()  # type: ignore[index]


class Fields:
    """One mapping being read. Call `finish()` last: it reports keys nobody asked for."""

    def __init__(self, problems: Problems, path: str, raw: object) -> None:
        self.problems = problems
        self.path = path
        self.ok = isinstance(raw, Mapping)
        if not self.ok:
            problems.add(path, f"expected a mapping of keys to values, got {describe(raw)}")
        self.raw: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        self.known: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str) -> Any:
        self.known.add(key)
        return self.raw.get(key)

    def has(self, key: str) -> bool:
        return key in self.raw

    def problem(self, key: str, message: str) -> None:
        self.problems.add(self.at(key), message)

    def one_line(self, key: str, value: str) -> bool:
        """False, with the problem recorded, when `value` holds a newline or another control.

        Every text of a stack ends up in a unit file, an env file, a rule set or a config, where
        a newline would start a directive of its own.
        """
        character = control_character(value)
        if character is None:
            return True
        self.problem(key, f"{value!r} holds {describe_character(character)}; write it on one line")
        return False

    def text(self, key: str, default: str | None = None, *, example: str = "") -> str:
        value = self._get(key)
        if value is None:
            if default is None and self.ok:
                hint = f"; add {key}: {example}" if example else ""
                self.problem(key, f"missing{hint}")
            return default or ""
        if is_secret(value):
            self.problem(key, "is encrypted but is not a secret field; set it in plain text")
            return ""
        if not isinstance(value, str) or not value.strip():
            self.problem(key, f"expected a non-empty string, got {describe(value)}")
            return ""
        return value if self.one_line(key, value) else ""

    def name(self, key: str = "name") -> str:
        value = self.text(key)
        if value and not NAME_PATTERN.fullmatch(value):
            self.problem(key, f'"{value}" is not a valid name; {NAME_RULE}')
        return value

    def choice(self, key: str, options: tuple[str, ...], default: str | None = None) -> str:
        value = self.text(key, default, example=options[0])
        if value and value not in options:
            self.problem(key, f'"{value}" is not one of {", ".join(options)}')
            return ""
        return value

    def integer(self, key: str, default: int | None, low: int, high: int | None = None) -> int:
        value = self._get(key)
        if value is None:
            if default is None and self.ok:
                self.problem(key, f"missing; add {key}: {low}")
            return default if default is not None else low
        if not finite(value) or value != int(value):
            self.problem(key, f"expected a whole number, got {describe(value)}")
            return default if default is not None else low
        number = int(value)
        if number < low or (high is not None and number > high):
            bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
            self.problem(key, f"{shown_number(number)} is out of range; use a number {bounds}")
            return default if default is not None else low
        return number

    def number(self, key: str) -> float | None:
        value = self._get(key)
        if value is None:
            return None
        if not finite(value) or not fits_float(value):
            self.problem(key, f"expected a number >= 0, got {describe(value)}")
            return None
        if value < 0:
            self.problem(key, f"{value:g} is below 0; give a number >= 0")
            return None
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.problem(key, f"expected true or false, got {describe(value)}")
            return default
        return value

    def text_list(
        self, key: str, *, required: bool = False, list_example: str = ""
    ) -> tuple[str, ...]:
        """A list of strings; one string stands for a list of itself, unless `list_example`
        is given (an argument vector: one string would be one argument), which it is shown."""
        value = self._get(key)
        if value is None:
            if required and self.ok:
                self.problem(key, "missing; give a list")
            return ()
        if isinstance(value, str) and list_example:
            self.problem(
                key, f"one string is one argument; write each as an item, e.g. {list_example}"
            )
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.problem(key, f"expected a list of non-empty strings, got {describe(value)}")
            return ()
        return tuple(v for v in value if self.one_line(key, v))

    def env(self, key: str) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, Secret], ...]]:
        """Environment variables: the plain ones, and those given as `secure:` (Pulumi secrets)."""
        value = self._get(key)
        if value is None:
            return (), ()
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and (is_secret(v) or isinstance(v, str) or _writable_number(v))
            for k, v in value.items()
        ):
            self.problem(key, "expected a mapping of names to string values or secure: values")
            return (), ()
        plain, secret = [], []
        for name, raw in value.items():
            if not ENV_NAME.fullmatch(name):
                self.problem(key, f"{name!r} is not a variable name; {ENV_RULE}")
            elif name in DEPLOY_ENV:
                self.problem(f"{key}.{name}", "set by the deploy for every replica; remove it")
            elif is_empty_secret(raw):
                self.problem(f"{key}.{name}", EMPTY_SECRET)
            elif is_secret(raw):
                secret.append((name, Secret(raw["secure"])))
            elif self.one_line(f"{key}.{name}", str(raw)):
                plain.append((name, str(raw)))
        return tuple(sorted(plain)), tuple(sorted(secret, key=lambda entry: entry[0]))

    def secret(self, key: str, *, required: bool, how: str) -> Secret | None:
        value = self._get(key)
        if value is None:
            if required and self.ok:
                self.problem(key, f"missing; {how}")
            return None
        if not is_secret(value):
            self.problem(key, f"must be a Pulumi secret, never plain text; {how}")
            return None
        if is_empty_secret(value):
            self.problem(key, EMPTY_SECRET)
            return None
        return Secret(value["secure"])

    def items(self, key: str, *, required: bool = True) -> Iterator[tuple[str, Any]]:
        value = self._get(key)
        if value is None:
            if required and self.ok:
                self.problem(key, "missing; give a list")
            return
        if not isinstance(value, list):
            self.problem(key, f"expected a list, got {describe(value)}")
            return
        if required and not value:
            self.problem(key, "is empty; give at least one entry")
        for index, item in enumerate(value):
            yield f"{self.at(key)}[{index}]", item

    def child(self, key: str) -> "Fields | None":
        value = self._get(key)
        if value is None:
            return None
        return Fields(self.problems, self.at(key), value)

    def finish(self) -> None:
        for key in self.raw:
            if key in self.known:
                continue
            text = str(key)
            close = difflib.get_close_matches(text, sorted(self.known), n=1)
            fix = (
                f'did you mean "{close[0]}"?'
                if close
                else f"known keys: {', '.join(sorted(self.known))}"
            )
            # A key with a newline in it is shown escaped, so the message stays one line.
            self.problems.add(
                self.at(repr(key) if control_character(text) else text), f"unknown key; {fix}"
            )


def listed_twice(names: list[str]) -> list[str]:
    """The names (not empty) that stand more than once in `names`, sorted."""
    return sorted(n for n, c in Counter(names).items() if c > 1 and n)
