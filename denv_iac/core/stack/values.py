"""What a value may look like before it reaches a unit file, a command line, a rule or a config.

The stack reader and the node spec both check values here, so a value refused in a stack file is
refused when it comes from a node spec or a command-line flag too. The writers quote what they
write as well; these checks are what makes a refusal name the field instead of a broken node.
"""

import ipaddress
import re

# Check every value against these patterns with `fullmatch`: `$` also matches before a final
# newline, so `match` would pass a value that starts a line of its own where it is written.

# A host name (RFC 1123 labels) or an IP address. A leading '-' would be read as an option by
# ssh and every other tool that takes a host, so no label may start with one.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")
HOST_RULE = "write a host name in letters, digits, '.' and '-', no part starting with '-'"
# A login name as useradd accepts it; it goes into SSH logins and sudo.
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
USER_RULE = "use a login name of lower-case letters, digits, '_' and '-', starting with a letter"
# A container image reference: registry/path:tag or @digest. Its first character may not be '-',
# or `docker run` would take the image for one of its own options.
IMAGE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]{0,254}$")
IMAGE_RULE = "give a container image reference like vllm/vllm-openai:v0.11.0"
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
ENV_RULE = "use letters, digits and '_', not starting with a digit"
# An OpenAI model name (`openai/whisper-large-v3`, `tts-1:hd`): safe in a map file, in JSON and
# in a single-quoted HAProxy string.
MODEL_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
# What the deploy itself sets in every replica: the caches on the node's lasting storage.
CACHE_ENV = ("HF_HOME", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR")
# ... and the replica's own GPU; a recipe's env may set none of these.
DEPLOY_ENV = (*CACHE_ENV, "NVIDIA_VISIBLE_DEVICES")


# Lambda names allow letters, digits and '-', starting with a letter, at most 60 characters.
LAMBDA_NAME_LENGTH = 60
_LAMBDA_CHARACTERS = re.compile(r"[^A-Za-z0-9-]")
# A Kubernetes label value: at most 63 of these, starting and ending with a letter or digit.
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def lambda_full_name(*parts: str) -> str:
    """The dash-joined parts in Lambda's characters, before the name is cut to its length."""
    name = _LAMBDA_CHARACTERS.sub("-", "-".join(parts))
    return name if name[:1].isalpha() else f"denv-{name}"


def lambda_name(*parts: str) -> str:
    """A name Lambda accepts for an instance, SSH key or filesystem, from dash-joined parts."""
    return lambda_full_name(*parts)[:LAMBDA_NAME_LENGTH].rstrip("-")


# A Nebius instance's host name (`{stack}-{site}-{node}`), as its API takes it.
NEBIUS_HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,61}[a-z0-9]$")
_NEBIUS_CHARACTERS = re.compile(r"^[a-z0-9-]*$")


def machine_name(stack: str, site: str, node: str) -> str:
    """The host name and `Name` tag of a machine: unique across stacks sharing an account."""
    return f"{stack}-{site}-{node}"


def nebius_host_problem(stack: str, site: str, node: str) -> str:
    """Why Nebius would refuse the host name of this node, in words naming the fix; "" if not.
    Site and node names are lower-case letters, digits and '-' already: the stack name's
    characters and the length are what can be wrong."""
    host = machine_name(stack, site, node)
    if NEBIUS_HOST_NAME.fullmatch(host):
        return ""
    if not _NEBIUS_CHARACTERS.fullmatch(stack):
        return (
            f'the stack name "{stack}" begins the host name of each machine of this Nebius site '
            f"({host}), which Nebius takes in lower-case letters, digits and '-' only; use a "
            "stack name of those"
        )
    return (
        f"Nebius host names of this site, like {host}, take {len(host)} characters, past "
        "Nebius's 63; shorten the site or the stack name"
    )


# Nebius boot images with drivers, by GPU: CUDA 12 families for Hopper; Blackwell (B200) needs
# a driver branch the CUDA 12 families do not carry, so the CUDA 13 family. Public Nebius
# examples use `ubuntu22.04-cuda12`, `ubuntu24.04-cuda12` and `ubuntu24.04-cuda13.0`; the
# family list of an account (`nebius compute image list-public`) is the authority.
NEBIUS_IMAGE_FAMILY = "ubuntu22.04-cuda12"
NEBIUS_IMAGE_FAMILY_BY_GPU = {"B200": "ubuntu24.04-cuda13.0"}


def nebius_image_family(gpu: str) -> str:
    """The default image family of a Nebius site whose offering has this GPU."""
    return NEBIUS_IMAGE_FAMILY_BY_GPU.get(gpu, NEBIUS_IMAGE_FAMILY)


def control_character(text: str) -> str | None:
    """The first character that would end or bend a line of a unit, env file or rule, if any.

    Newlines start a new directive in a systemd unit and a new variable in an env file; the
    other C0/C1 controls and the Unicode line separators are no safer in a log or a terminal.
    """
    for character in text:
        code = ord(character)
        if code < 0x20 or 0x7F <= code < 0xA0 or character in "\u2028\u2029":
            return character
    return None


def describe_character(character: str) -> str:
    return {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}.get(
        character, f"the control character U+{ord(character):04X}"
    )


def is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return bool(HOST_NAME.fullmatch(text))
    return True
