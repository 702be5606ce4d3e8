// Stop requests: SIGTERM (Slurm preemption, `scancel`, `kill`), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's
// `sbatch --signal=B:USR1@120`, and what mpirun forwards to its ranks without killing them) ask a training
// run to stop after the step it is in: every rank finishes that step, the ranks agree on the stop in the
// step's loss all-reduce, a checkpoint is written when save_folder is set, and the process exits with
// 128 + the signal number, the shell's code for "ended by that signal". A second such signal more than
// two seconds after the first ends the process at once (Ctrl-C twice); one within two seconds is taken as
// the same request (a terminal's Ctrl-C reaches `trainer launch` and its ranks, which the launcher also
// forwards it to).
#pragma once

namespace trainer::stop {

// Installs the handlers (idempotent). Called by the training loop before its first step.
void install();
// The first stop signal received since install(), or 0.
int requested();
// The exit code of a run stopped by `sig`: 128 + sig.
inline int exit_code(int sig) { return 128 + sig; }
// "SIGTERM", "SIGINT", "SIGUSR1", else "a signal".
const char* signal_name(int sig);

// Agreement across ranks, in the step's loss all-reduce: each rank adds kVotes doubles, 1 at the index of
// the signal it received (SIGTERM, SIGINT, SIGUSR1), and every rank reads the same sums.
constexpr int kVotes = 3;
void vote(double* votes);
// The signal the summed votes agree on (the most voted; SIGTERM, then SIGINT on ties), 0 when none.
int agreed(const double* summed_votes);

}  // namespace trainer::stop
