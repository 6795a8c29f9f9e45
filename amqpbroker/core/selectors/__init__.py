"""JMS 2.0 message selectors (JMS 2.0 / Jakarta Messaging 3.1 §3.8.1).

    sel = compile_selector("JMSType = 'car' AND weight > 2500")   # cached
    sel.matches(lookup)   # lookup(name) -> value, or None when the message lacks it

An empty selector means "no selector" and must be handled by the caller; it is rejected
here with SelectorError.
"""

from .compiler import Selector, SelectorError, Stats, check_length, compile_selector
from .like import EVALUATION_BUDGET, TURN_BUDGET, SelectorBudgetExceeded, spent

__all__ = ["EVALUATION_BUDGET", "TURN_BUDGET", "Selector", "SelectorBudgetExceeded", "SelectorError", "Stats",
           "check_length", "compile_selector", "spent"]
