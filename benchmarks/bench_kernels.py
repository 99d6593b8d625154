"""asv benchmarks of the kernels at production shapes (see ``common.kernel_cases``).

One parametrised class: ``Kernels.time_kernel('<name>')`` and ``Kernels.peakmem_kernel('<name>')``.
A case that cannot run here (its private function has gone as the package's internals move, or
its backend tier is missing on this CPU or in an older commit) is skipped.
"""

from . import common

_STATES: dict[str, dict] = {}


class Kernels:
    params = list(common.kernel_cases())
    param_names = ["kernel"]
    number = 1            # setup runs before every call: in-place kernels get fresh data
    repeat = (3, 20, 10.0)
    warmup_time = 0
    timeout = 600

    def setup(self, name):
        case = common.kernel_cases()[name]
        why = common.unavailable(case)
        if why:
            raise NotImplementedError(why)
        if name not in _STATES:
            _STATES[name] = st = case.build()
            if case.prepare:
                case.prepare(st)
            case.run(st)          # warm: numba loads the kernel from its cache
        self.case, self.state = case, _STATES[name]
        if case.prepare:
            case.prepare(self.state)

    def time_kernel(self, name):
        self.case.run(self.state)

    def peakmem_kernel(self, name):
        self.case.run(self.state)
