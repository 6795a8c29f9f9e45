"""The shared-subscription, JMS-feature and transaction end-to-end scenarios, run
against the broker image (the `broker` fixture here starts a container)."""

import pytest

from tests.e2e.test_jms_features import *  # noqa: F401,F403
from tests.e2e.test_shared_subscriptions import *  # noqa: F401,F403
from tests.e2e.test_transactions import (  # noqa: F401
    test_commit_makes_staged_sends_visible,
    test_connection_drop_rolls_back,
    test_coordinator_attach_offers_local_transactions,
    test_mixed_send_and_ack_commit_atomically,
    test_rollback_returns_acknowledged_messages_redelivered,
)

pytestmark = pytest.mark.container
