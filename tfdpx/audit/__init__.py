"""Empirical privacy auditing: a statistical lower bound on epsilon.

Train with canaries, score how well an attacker tells included ones from
excluded ones, and turn the guesses into a lower bound on the true epsilon
that holds at a confidence level. A lower bound above the printed epsilon,
or a run that breaks the tradeoff curve its accountant claims
(`fdp_bounds`), means the implementation is broken. `python -m tfdpx.audit`
runs the audits of docs/auditing.md.
"""

from tfdpx.audit.bounds import one_run_audit
from tfdpx.audit.bounds import one_run_epsilon_lower_bound
from tfdpx.audit.bounds import one_run_p_value
from tfdpx.audit.bounds import two_run_epsilon_lower_bound
from tfdpx.audit.canaries import GradientCanaries
from tfdpx.audit.canaries import InputCanaries
from tfdpx.audit.fdp_bounds import claimed_profile
from tfdpx.audit.flaws import FlawedGaussian
from tfdpx.audit.run import one_run
from tfdpx.audit.run import train_with_canaries
from tfdpx.audit.run import two_run
