"""The refusal of an attach: raised while an attach is handled, answered by the
connection handler with a null terminus and a detach carrying the error (AMQP 1.0
§2.6.3; Qpid JMS checks the null source/target, shared/notes/qpid-jms-wire.md)."""

from __future__ import annotations

from proton import Condition, Link

from .terminus import write_null


class AttachRefused(Exception):
    def __init__(self, condition: str, description: str):
        super().__init__(description)
        self.condition = condition
        self.description = description


def refuse_link(link: Link, condition: str, description: str) -> None:
    """Null terminus + detach with the error: the refusal shape clients understand
    (AMQP 1.0 §2.6.3; Qpid JMS checks for the null source/target)."""
    if link.is_sender:
        write_null(link.source)
        link.target.copy(link.remote_target)
    else:
        write_null(link.target)
        link.source.copy(link.remote_source)
    link.open()
    link.condition = Condition(condition, description)
    link.close()


def detach_with_condition(link: Link) -> None:
    """Detach (closed=false) carrying link.condition: proton's Link.detach() does not
    copy the condition into the engine the way close() does."""
    link._update_cond()
    link.detach()
