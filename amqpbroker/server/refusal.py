"""The refusal of an attach: raised while an attach is handled, answered by the
connection handler with a null terminus and a detach carrying the error (AMQP 1.0
§2.6.3; Qpid JMS checks the null source/target, shared/notes/qpid-jms-wire.md)."""

from __future__ import annotations


class AttachRefused(Exception):
    def __init__(self, condition: str, description: str):
        super().__init__(description)
        self.condition = condition
        self.description = description
