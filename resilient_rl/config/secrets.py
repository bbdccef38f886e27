"""Credentials never leave the process: the one redaction used wherever config or text does.

Everything a run writes about itself goes through here: the saved ``config.yaml``, the
hyperparameters handed to the trackers (wandb, MLflow, TensorBoard), ``resilient-rl status``,
events and the log (``train.log`` and the console). Three kinds of secret are recognised:

- the value of a credential-like *key* in a free-form mapping (``checkpoint.storage_options`` and
  anything nested in it), however it is spelled: ``secret``, ``aws_secret_access_key``,
  ``secretAccessKey``, ``accessKey``, ``apiKey``, ``X-Api-Key``, ``Authorization``, ``passphrase``,
  ``password``, ``session_token``, ``credentials``, ``connection_string``, ...;
- credentials inside a URL (``https://user:pw@host/...``) and credential-like query parameters
  (``?X-Amz-Signature=...``, ``?sas_token=...``), in any string;
- ``Bearer``/``Basic`` authorization values in any string.

Text (log lines, error messages) is also scrubbed of every secret value this process has seen in a
config (:func:`remember_secrets`), so a key that reaches a message by another way (an exception
quoting an option) is still caught. Keys on the command line are recorded by shells and by
process listings: give credentials through the environment or a credential file instead
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``~/.aws/credentials``, ``AWS_PROFILE``).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

__all__ = ["REDACTED", "RedactingFilter", "is_secret_key", "redact", "redact_text", "remember_secrets"]

REDACTED = "<redacted>"

# Words that make a key a credential, matched on whole words of the key once camelCase, dashes,
# dots and spaces are turned into underscores ("secretAccessKey" -> secret_access_key).
_SECRET_WORDS = ("key", "keys", "secret", "secrets", "token", "password", "passwd", "passphrase", "pwd",
                 "credential", "credentials", "creds", "signature", "sas", "auth", "authorization", "cookie",
                 "apikey", "accesskey", "secretkey", "privatekey")
_SECRET_RE = re.compile(r"(?:^|_)(?:%s)(?:_|$)|connection_?string" % "|".join(_SECRET_WORDS))
_CAMEL_RE = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
# scheme://userinfo@ : the userinfo (user:password, or a bare token) is the secret.
_URL_USERINFO_RE = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://)([^/@\s?#]+)@")
_QUERY_RE = re.compile(r"([?&;])([^=&#\s]+)=([^&#\s\"']*)")
# A credential after Bearer/Basic looks like one (a digit or a base64/JWT character in it), so
# prose such as "Basic authentication" is left alone.
_BEARER_RE = re.compile(r"\b(Bearer|Basic)\s+(?=[A-Za-z0-9._~+/=\-]*[0-9._~+/=\-])[A-Za-z0-9._~+/=\-]{6,}",
                        re.IGNORECASE)
# key=value / key: value / "key": "value" in free text, for credential-like keys.
_ASSIGN_RE = re.compile(r"""(["']?)([A-Za-z0-9_.\-]+)\1(\s*[=:]\s*)(["']?)([^\s"',}\]]+)\4""")

_seen: set[str] = set()
_seen_lock = threading.Lock()


def is_secret_key(key: Any) -> bool:
    """Whether a mapping key names a credential (any spelling: snake, camel, kebab, dotted)."""
    if not isinstance(key, str):
        return False
    words = re.sub(r"[\s.\-]+", "_", _CAMEL_RE.sub("_", key)).lower()
    return bool(_SECRET_RE.search(words))


def _redact_string(text: str) -> str:
    text = _URL_USERINFO_RE.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    text = _QUERY_RE.sub(lambda m: f"{m.group(1)}{m.group(2)}={REDACTED}" if is_secret_key(m.group(2))
                         else m.group(0), text)
    return _BEARER_RE.sub(lambda m: f"{m.group(1)} {REDACTED}", text)


def redact(value: Any, keys: bool = True) -> Any:
    """``value`` with every secret replaced by :data:`REDACTED`: the values of credential-like keys
    (at any depth; only when ``keys``: typed records whose field names are not free-form, such as
    events, pass False) and credentials inside strings. Other keys and values are kept, so
    non-secret options survive a save."""
    if isinstance(value, dict):
        # Numbers and flags under such keys (``use_auth: true``, ``pad_token_id: 0``) are settings.
        return {k: (REDACTED if keys and is_secret_key(k) and isinstance(v, (str, bytes, dict, list, tuple))
                    else redact(v, keys)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v, keys) for v in value)
    if isinstance(value, str):
        return _redact_string(value)
    return value


def _collect(value: Any, out: set[str], secret: bool = False) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _collect(v, out, secret or is_secret_key(k))
    elif isinstance(value, (list, tuple)):
        for v in value:
            _collect(v, out, secret)
    elif isinstance(value, str):
        if secret and len(value) >= 4 and value != REDACTED:
            out.add(value)
        for m in _URL_USERINFO_RE.finditer(value):
            out.update(p for p in m.group(2).split(":") if len(p) >= 4)


def remember_secrets(value: Any) -> None:
    """Note the secret values inside ``value`` (a config dict, storage options): text written
    later by this process (:func:`redact_text`) has them replaced wherever they appear."""
    found: set[str] = set()
    _collect(value, found)
    with _seen_lock:
        _seen.update(found)


def redact_text(text: str) -> str:
    """Free text (a log line, an error message) with every known secret value, credentials in
    URLs, authorization values and ``key=value`` assignments of credential-like keys redacted."""
    with _seen_lock:
        known = sorted(_seen, key=len, reverse=True)
    for secret in known:
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = _redact_string(text)
    return _ASSIGN_RE.sub(lambda m: (f"{m.group(1)}{m.group(2)}{m.group(1)}{m.group(3)}{m.group(4)}{REDACTED}"
                                     f"{m.group(4)}" if is_secret_key(m.group(2).rsplit(".", 1)[-1])
                                     and m.group(5) != REDACTED and not m.group(5).isdigit() else m.group(0)), text)


class RedactingFilter(logging.Filter):
    """A handler filter: the record's message and traceback are redacted (:func:`redact_text`)
    before any handler formats them."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: leave it to the handler's own error path
            return True
        record.msg, record.args = redact_text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def without_redacted(value: Any, prefix: str = "") -> tuple[Any, list[str]]:
    """``value`` (options read back from a saved config) without its redacted entries, and the
    dotted keys dropped: a reader must use its own credentials (environment, credential files),
    never pass :data:`REDACTED` to a storage backend as if it were one."""
    dropped: list[str] = []
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if v == REDACTED:
                dropped.append(key)
                continue
            out[k], inner = without_redacted(v, key)
            dropped += inner
        return out, dropped
    if isinstance(value, list):
        items = [without_redacted(v, f"{prefix}[{i}]") for i, v in enumerate(value)]
        return [v for v, _ in items], [k for _, ks in items for k in ks]
    if isinstance(value, str) and REDACTED in value:
        return value, [prefix]
    return value, dropped
