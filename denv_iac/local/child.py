"""ChildProcess's former home: it lives in denv_iac.child_process, below the installed HAProxy
and the local data plane that both use it. Kept for the modules that still import it here."""

from denv_iac.child_process import ChildProcess as ChildProcess
