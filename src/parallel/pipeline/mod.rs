//! Pipeline parallelism (issue 40): the model's layers split into stages over ranks, the
//! micro-batches of a step flowing through them. So far: the schedules, as data
//! ([`schedule`]), with a unit-cost simulation that the tests hold to the closed forms of each
//! schedule's bubble. The engine that runs them on ranks is the next step.

pub mod schedule;
