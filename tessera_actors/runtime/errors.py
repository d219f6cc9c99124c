"""Errors raised by the actor runtime and the transport.

Every ``ask`` ends in exactly one of: the handler's return value, or one of
these errors.  The same classes are raised for local and remote actors.

* ``ActorDead``      - the actor is stopped (or never existed); pending,
                       queued and later asks fail with it.
* ``AskTimeout``     - no answer within the ask's timeout (also a peer that
                       cannot be reached).  Subclass of ``TimeoutError``.
* ``UnknownMessage`` - the actor has no handler for that message type.
* ``RemoteError``    - the handler raised; ``.kind`` is the exception class
                       name, ``.message`` its text.  For local asks the
                       original exception is kept as ``__cause__``.
* ``CodecError``     - malformed or oversized frames, unknown message kind,
                       protocol version mismatch, unencodable value.
* ``MailboxFull``    - a non-waiting send found the mailbox full.
"""
from __future__ import annotations


class ActorError(Exception):
    """Base class of every error of the actor runtime and transport."""


class ActorDead(ActorError):
    """The target actor is stopped or does not exist."""


class NoSuchActor(ActorDead, LookupError):
    """No actor is registered under that name (a kind of ``ActorDead``)."""


class NameTaken(ActorError, ValueError):
    """``spawn`` was given a name that is already in use in that system."""


class AskTimeout(ActorError, TimeoutError):
    """The ask got no answer within its timeout."""


class UnknownMessage(ActorError):
    """The actor has no handler for the message's type."""


class RemoteError(ActorError):
    """A handler raised while answering an ask.

    ``kind`` is the handler exception's class name and ``message`` its text;
    ``str()`` reads ``"ValueError: bad input"``.
    """

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message)
        self.kind = kind
        self.message = message

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class CodecError(ActorError):
    """A message could not be encoded or frames could not be decoded."""


class MailboxFull(ActorError):
    """A non-waiting send (``tell_nowait``) found the mailbox full."""


# Errors that the runtime itself (not a handler) produces; they cross the wire
# by class name and are re-raised as the same class on the asking side.
RUNTIME_ERRORS: dict[str, type[ActorError]] = {
    cls.__name__: cls
    for cls in (ActorError, ActorDead, NoSuchActor, NameTaken, AskTimeout,
                UnknownMessage, CodecError, MailboxFull)
}
