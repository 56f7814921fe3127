"""``DumpHost``: what a dump service offers its parts (``dump.call_records.CallRecords``,
``dump.user_api.UserApi``), the one list of the service's state and methods they use.

``dump.service.DumpServiceBase`` is the one implementation; the parts are typed against this protocol
(and the framework's methods against ``dump.backend.DumpBackend``), so they name what they need without
importing the service that holds them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Optional, Protocol

if TYPE_CHECKING:
    from msprobe_core.dump.call import Call
    from msprobe_core.dump.config import DumpConfig
    from msprobe_core.dump.selection import RecordSelection
    from msprobe_core.files.step_recorder import StepRecorder


class DumpHost(Protocol):
    """The dump service as its parts see it."""

    cfg: DumpConfig
    selection: RecordSelection
    summarizer: Any                         # statistics and tensor files of one value (the back-end's)
    recorder: Optional[StepRecorder]        # the open step's dump.json (None until the step's first record)
    debug_recorder: Optional[StepRecorder]  # the open step's debug.json (``save``)
    dumping_thread: int                     # the thread that called start(): the only one recorded
    finished: bool                          # the last configured step is dumped
    forward_handles: list[Any]              # module hooks, removed at stop()
    uses_l0: bool                           # level L0 or mix: module records (and construct.json parents)
    saves_tensors: bool                     # task tensor: every record's tensor files

    @property
    def collecting(self) -> bool:
        """Between start() and stop()."""
        ...

    def set_exclusive(self, module: Any) -> None:
        """Record only ``module`` (``module_dump``), or everything again (None)."""
        ...

    def should_record(self) -> bool:
        """Record an API or module call now?"""
        ...

    def _may_record_exclusive(self) -> bool:
        """Inside a ``module_dump`` window: may its module record now?"""
        ...

    def _other_thread(self) -> bool:
        """A call from a thread that is not the dumping thread (said once per thread); False."""
        ...

    def _in_configured_step(self) -> bool:
        """Is this rank and step to be dumped?"""
        ...

    def _open_step(self) -> StepRecorder:
        """The open step's dump.json recorder (made at the step's first record)."""
        ...

    def _open_debug(self) -> StepRecorder:
        """The open step's debug.json recorder."""
        ...

    def _sync(self, record_on_device: bool = False, force: bool = False) -> None:
        """A record is complete: resolve statistics and append journal lines (now or in batches)."""
        ...

    def _own(self, where: str) -> ContextManager[None]:
        """The tool's own work: nothing inside is recorded, an exception goes to dump_error_info.log."""
        ...

    def _error(self, where: str, exc: BaseException) -> None:
        """Log an error of the tool's own work (never raised into the user's program)."""
        ...

    def _end(self, call: Call, out: Any, same_values_as: Any = None) -> None:
        """Finish ``call``'s record with its output (the back-end may add its own work)."""
        ...
