//! Pipeline parallelism (issue 40): the model's layers split into stages over ranks, the
//! micro-batches of a step flowing through them. The schedules are data ([`schedule`]), with a
//! unit-cost simulation that the tests hold to the closed forms of each schedule's bubble;
//! [`stages`] cuts the layers into chunks; stages talk through the communicators'
//! point-to-point calls, matched by name in a [`mailroom`]. `train::pipeline` executes a
//! schedule on a stage's rank.

pub mod mailroom;
pub mod schedule;
pub mod stages;
