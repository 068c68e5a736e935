"""Empirical privacy auditing of a training run, in one run (TensorFlow side).

Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run".
The bound and the guesses are pure functions in `tfdp.accounting.audit`; this
package puts canaries into a run:

* `GradientCanaryDPModel`: Dirac gradient canaries in the clipped sum
  (white box: audits the noise against the claimed sensitivity and sampling).
* `GradientCanaryAudit` / `InputCanaryAudit`: hooks for
  `tfdp.train_and_evaluate(audit=...)` (what `tools/audit.py` runs): they
  draw the canaries, build the model or the training split, and put the
  result in the privacy report's "audit" section.
"""

from tfdp.audit.gradient_canary_dp_model import GradientCanaryDPModel
from tfdp.audit.gradient_canary_audit import GradientCanaryAudit
from tfdp.audit.input_canary_audit import InputCanaryAudit
