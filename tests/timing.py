"""The one margin that wall-clock assertions of the data plane add to a budget they check.

A stream on a frozen replica must end within the stall budget; a retried request must get its
first token within the first-token budget. What a caller sees beyond the budget is HAProxy's
timer wheel, a healthy replica's own first token, and the scheduling of two shared cores: the
margin is measured with `make bench` running beside the tests (the worst case below), and the
tests that use it carry the `timing` marker.
"""

TIMER_SLACK_S = 0.1
