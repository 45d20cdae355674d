#pragma once
// Test-only access to a Scheduler's private state (the friend that
// scheduler.h declares), so that a test can corrupt one piece of
// bookkeeping and expect check_invariants() to fire: a checker that checks
// nothing would otherwise pass every test.
#include "../../scheduler/src/scheduler_impl.h"

namespace mixkv::test {

struct SchedulerAccess {
  static Scheduler::Impl& impl(Scheduler& sched) { return *sched.impl_; }
  static scheduler_detail::Entry& entry(Scheduler& sched, RequestId id) { return impl(sched).entries.at(id); }
};

}  // namespace mixkv::test
