"""asv benchmarks of the kernels at production shapes (see ``kernel_cases.kernel_cases``).

One parametrised class: ``Kernels.time_kernel('<name>')`` and ``Kernels.peakmem_kernel('<name>')``.
A case that cannot run here (its private function has gone as the package's internals move, or
its backend tier is missing on this CPU or in an older commit) is skipped.
"""

from . import common, kernel_cases

_STATES: dict[str, dict] = {}


class Kernels:
    """Each case in processes of its own (asv forks one per case and round).

    Why these settings (measured on the shared 2-core machine, docs/performance.md): a process's
    speed differs from the next one's by more than a sample's spread, so a comparison needs
    several processes a commit (``rounds``, interleaved with ``--interleave-rounds``) and several
    samples each (``repeat``), each the mean of ``number`` calls (asv re-runs the set-up before
    each call and times the calls alone, so in-place kernels still get fresh data; a millisecond
    kernel's single call swung 3-27 ms under load), for asv's rank test to have something to
    rank; ``--quick`` (one sample, one process) only shows that the suite runs. Set-up runs each
    kernel twice untimed (numba loads it from its cache; numba's threads start; the first pass's
    page faults), and then resets the peak RSS, so ``peakmem_kernel`` is the case's data and the
    call, not numba compiling or loading in the same process.
    """

    params = list(kernel_cases.kernel_cases())
    param_names = ["kernel"]
    number = 4            # a sample: the mean of 4 calls, each timed alone after its set-up
    repeat = (6, 12, 6.0)
    rounds = 3
    warmup_time = 0
    timeout = 600

    def setup(self, name):
        case = kernel_cases.kernel_cases()[name]
        why = kernel_cases.unavailable(case)
        if why:
            raise NotImplementedError(why)
        if name not in _STATES:
            _STATES[name] = st = case.build()
            if case.prepare:
                case.prepare(st)
            for _ in range(2):    # warm: numba loads the kernel from its cache, threads start
                case.run(st)
                if case.prepare:
                    case.prepare(st)
            common.reset_peak_rss()
        self.case, self.state = case, _STATES[name]
        if case.prepare:
            case.prepare(self.state)

    def time_kernel(self, name):
        self.case.run(self.state)

    def peakmem_kernel(self, name):
        self.case.run(self.state)
