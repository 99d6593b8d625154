"""asv benchmarks of the kernels at production shapes (see ``common.kernel_cases``).

One parametrised class: ``Kernels.time_kernel('<name>')`` and ``Kernels.peakmem_kernel('<name>')``.
A case whose private function has gone (the package's internals move) is skipped.
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
        if not common.private_available(case):
            raise NotImplementedError(f"{case.private} no longer exists")
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
