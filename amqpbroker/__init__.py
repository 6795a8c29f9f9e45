"""amqpbroker: an AMQP 1.0 broker for JMS 2.0 shared subscriptions."""

__version__ = "0.1.0"
PRODUCT = "amqpbroker"
