"""`strata-node` whose NVML is a fake one with one RTX 2080 Ti (tests: a worker PC's GPUs on a machine without any):

python -m tests.app.fake_gpu_node serve --host ADDR --port P --json
"""

import functools
import sys

from engine.node import cli, cli_local
from tests.engine.node.fake_nvml import ClockNvml
from tests.installer.fake_nvml import FakeCard

RTX_2080_TI = FakeCard("NVIDIA GeForce RTX 2080 Ti", 11264, (7, 5), cores=4352, max_sm_clock=1545)

if __name__ == "__main__":
    cli_local.AgentOptions = functools.partial(cli_local.AgentOptions, nvml=ClockNvml([RTX_2080_TI]))  # type: ignore[misc]
    sys.exit(cli.main(sys.argv[1:]))
