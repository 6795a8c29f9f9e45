"""The refusal of an attach (and the ACL check that makes one): raised while an
attach is handled, answered by the connection handler with a null terminus and a
detach carrying the error (AMQP 1.0 §2.6.3; Qpid JMS checks the null source/target,
shared/notes/qpid-jms-wire.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from proton import Condition, Link

from ..security.guard import UNAUTHORIZED
from .terminus import read_source, read_target, write_null


class AttachRefused(Exception):
    def __init__(self, condition: str, description: str):
        super().__init__(description)
        self.condition = condition
        self.description = description


def check_access(access: Any, user: str | None, link: Link, container_id: str,
                 member: str | None = None) -> None:
    """The ACL (security/guard.py) on an attach: AttachRefused when not allowed.
    `member`: the address a link is served from instead of the one it names (a
    partitioned destination's member here: a producer's, server/ports.py `AttachHere`;
    a consumer's, cluster/fanin.py), checked as that member's node checks a forwarded
    link."""
    if not access.enabled:
        return
    if link.is_sender:
        source = read_source(link.remote_source)
        if member is not None:
            source = source.with_(address=member)
        refusal = access.consumer_refusal(user, source, link.name, container_id)
    else:
        target = read_target(link.remote_target)
        refusal = access.producer_refusal(user, target if member is None else replace(target, address=member))
    if refusal is not None:
        raise AttachRefused(UNAUTHORIZED, refusal)


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
