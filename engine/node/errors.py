"""The errors of the node agent's commands that a user can act on: each says what failed and what to do, and has a
`code` the app reads from `--json` answers."""


class NodeCliError(Exception):
    """A refusal or failure the `strata-node` commands report as `{"ok": false, "error": ..., "code": ...}`."""

    code: str = "failed"
