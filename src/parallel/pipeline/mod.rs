//! Pipeline parallelism (issue 40): the model's layers split into stages over ranks, the
//! micro-batches of a step flowing through them. So far: the schedules, as data
//! ([`schedule`]), with a unit-cost simulation that the tests hold to the closed forms of each
//! schedule's bubble; stages will talk through the communicators' point-to-point calls
//! (`Communicator::send`, `recv`, `send_recv`). The engine that runs the schedules on ranks is
//! the next step.

pub mod schedule;
