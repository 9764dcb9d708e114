"""accelerate's FSDP path on CPU processes over gloo, for tests and hand runs without a GPU.

    accelerate launch --use_fsdp --fsdp_version 2 --num_processes 2 tests/workers/fsdp_on_cpu.py \
        examples/train_image_classification.py --use_cpu true ...

accelerate (1.15) keeps an FSDP plugin only on accelerator devices: on CPU processes (`--use_cpu true`) it drops the
plugin without a word and trains with DDP. Imported, this module keeps the plugin there, as accelerate does on GPUs
(`AcceleratorState` sets the FSDP distributed type and the plugin); everything after that is accelerate's own code.
Run as a script, it then runs the script given as its first argument with the rest as that script's arguments.
"""

import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _init_keeping_fsdp(self: AcceleratorState, *args, fsdp_plugin=None, **kwargs) -> None:
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = fsdp_plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type


AcceleratorState.__init__ = _init_keeping_fsdp

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
