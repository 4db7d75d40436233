//! Constraints on what a request may generate (JSON schemas, regular expressions, grammars;
//! the server compiles them with llguidance, `crates/grammar`): before each of the request's
//! tokens the worker asks which tokens are allowed and masks the others out of the logits, so
//! that no sampling mode can choose them; after the choice it tells the constraint the token.
//!
//! The grammar work of a step is done in one place, [`masks`]: each constraint takes the token
//! chosen at the last step ([`Constraint::accept`] only records it) and computes its next mask,
//! the constraints of a step on threads of their own. A device backend calls it after it has
//! launched the step's forward pass, so the masks are computed while the GPU runs.

use std::sync::{Arc, Mutex};

/// A constraint's state for one request (one choice).
pub trait TokenConstraint: Send {
    /// The tokens allowed next: bit `t % 32` of word `t / 32`. A constraint that has ended or
    /// failed allows only the end-of-sequence tokens.
    fn allowed(&mut self) -> Vec<u32>;
    /// The token chosen (one the last [`TokenConstraint::allowed`] allowed).
    fn accept(&mut self, token: u32);
}

/// A constraint's state and the token chosen since it last computed a mask.
struct Inner {
    c: Box<dyn TokenConstraint>,
    pending: Option<u32>,
}

/// A request's constraint, shared with the worker that runs it.
#[derive(Clone)]
pub struct Constraint(Arc<Mutex<Inner>>);

impl Constraint {
    /// Wraps a constraint's state.
    pub fn new(c: impl TokenConstraint + 'static) -> Constraint {
        Constraint(Arc::new(Mutex::new(Inner { c: Box::new(c), pending: None })))
    }

    /// The tokens allowed now (bit `t % 32` of word `t / 32`), after taking the token chosen
    /// last.
    pub fn allowed(&self) -> Vec<u32> {
        let mut inner = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = inner.pending.take() {
            inner.c.accept(t);
        }
        inner.c.allowed()
    }

    /// Sets the logits of the tokens not allowed now to -inf.
    pub fn mask(&self, logits: &mut [f32]) {
        apply(&self.allowed(), logits);
    }

    /// Records the token chosen; the constraint takes it when it next computes a mask.
    pub fn accept(&self, token: u32) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pending = Some(token);
    }
}

/// Sets the logits of the tokens `allowed` (a mask as [`Constraint::allowed`] gives it) does not
/// allow to -inf.
pub fn apply(allowed: &[u32], logits: &mut [f32]) {
    for (t, l) in logits.iter_mut().enumerate() {
        if !allows(allowed, t as u32) {
            *l = f32::NEG_INFINITY;
        }
    }
}

/// Whether the mask `allowed` (as [`Constraint::allowed`] gives it) allows token `t`; tokens
/// past the mask are not allowed.
pub fn allows(allowed: &[u32], t: u32) -> bool {
    allowed.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// The masks of a step's rows (`None` for a row without a constraint), computed on rayon's
/// pool (one thread per core, kept between steps): a constraint's mask costs from tens of
/// microseconds to milliseconds, and a step may have hundreds of rows.
pub fn masks(rows: &[Option<Constraint>]) -> Vec<Option<Vec<u32>>> {
    use rayon::prelude::*;
    // A step without constraints (the usual one) stays off the pool.
    if rows.iter().all(Option::is_none) {
        return vec![None; rows.len()];
    }
    rows.par_iter().map(|r| r.as_ref().map(Constraint::allowed)).collect()
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// The same constraint (the same shared state).
impl PartialEq for Constraint {
    fn eq(&self, other: &Constraint) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows the tokens of a list in turn.
    struct Script(Vec<u32>);
    impl TokenConstraint for Script {
        fn allowed(&mut self) -> Vec<u32> {
            let mut w = vec![0u32; 2];
            if let Some(&t) = self.0.first() {
                w[t as usize / 32] |= 1 << (t % 32);
            }
            w
        }
        fn accept(&mut self, token: u32) {
            assert_eq!(self.0.remove(0), token);
        }
    }

    #[test]
    fn masks_all_but_the_allowed_tokens_and_advances() {
        let c = Constraint::new(Script(vec![33, 2]));
        let mut logits = vec![1.0f32; 40];
        c.mask(&mut logits);
        let kept: Vec<usize> = (0..40).filter(|&t| logits[t].is_finite()).collect();
        assert_eq!(kept, [33]);
        c.accept(33);
        let mut logits = vec![1.0f32; 70];
        c.mask(&mut logits);
        // Token 2 is allowed; tokens past the mask's 64 bits are not.
        assert_eq!((0..70).filter(|&t| logits[t].is_finite()).collect::<Vec<_>>(), [2]);
        assert_eq!(c.clone(), c);
    }

    #[test]
    fn masks_of_many_rows_each_take_their_token() {
        let rows: Vec<Option<Constraint>> =
            (0..40u32).map(|i| (i % 3 != 0).then(|| Constraint::new(Script(vec![i, 63 - i])))).collect();
        let bit = |m: &[u32], t: u32| m[t as usize / 32] >> (t % 32) & 1 == 1;
        for (i, m) in masks(&rows).iter().enumerate() {
            assert_eq!(m.is_some(), i % 3 != 0);
            if let Some(m) = m {
                assert!(bit(m, i as u32) && m.iter().map(|w| w.count_ones()).sum::<u32>() == 1);
            }
        }
        for (i, c) in rows.iter().enumerate() {
            if let Some(c) = c {
                c.accept(i as u32);
            }
        }
        // Each constraint took its own token (Script asserts it) and moved on.
        for (i, m) in masks(&rows).iter().enumerate() {
            assert_eq!(m.as_ref().map(|m| bit(m, 63 - i as u32)), (i % 3 != 0).then_some(true));
        }
    }
}
