"""`draftsmith doctor`: why a drafter's acceptance is low, proven with measurements (docs/doctor.md).

```python
from draftsmith.target_model import load_target
from draftsmith.doctor import diagnose

t = load_target("path/to/target", dtype="fp32")
report = diagnose(t, "path/to/drafter")     # any layout Drafter.from_pretrained reads, or an export dir
report["checks"]          # [{"name", "ok", "detail"}]: static checks, each failing one says the fix
report["acceptance_rate"], report["tau"], report["p_at_least"]   # measured as configured (greedy chain, K=4)
report["variants"]        # [{"fault", "label", "acceptance_rate", "tau", ...}]: each candidate mis-wiring
report["likely_faults"]   # [{"fault", "fix", "acceptance_rate", "variant_acceptance_rate", ...}]; [] = clean
```

Modules: measure.py (target traces, the simulated chain rounds), checks.py (static checks), diagnose.py
(variants and verdict), report.py (terminal table, PNG), prompts.py (built-in prompts), cli.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.common.lazy import lazy_exports

if TYPE_CHECKING:
    from draftsmith.doctor.diagnosis import FAULTS, diagnose

__all__ = ["FAULTS", "diagnose"]
# torch-free --help: the doctor CLI imports this package (draftsmith/common/lazy.py)
__getattr__, __dir__ = lazy_exports(__name__, {n: "draftsmith.doctor.diagnosis" for n in __all__})
