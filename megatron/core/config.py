"""Global switch for experimental features (megatron-core's ``megatron.core.config``).

This core has no experimental code paths; the flag is kept so scripts that set or read it
run unchanged.
"""

ENABLE_EXPERIMENTAL = False


def set_experimental_flag(flag: bool):
    """Turn experimental features on or off (read back with ``is_experimental_enabled``)."""
    global ENABLE_EXPERIMENTAL
    ENABLE_EXPERIMENTAL = flag


def is_experimental_enabled():
    """The value last given to ``set_experimental_flag`` (False by default)."""
    return ENABLE_EXPERIMENTAL
