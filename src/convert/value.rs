//! What a pickle builds ([`super::pickle`] runs it): numbers, strings, containers and inert
//! records of calls. The shapes are chosen so that a hostile file of n bytes costs O(n) memory
//! and time, whatever it does:
//! - strings and bytes are shared (`Rc`), so fetching a large memoized string again is a
//!   pointer copy, not a copy of its bytes;
//! - a call's arguments share the tuple they came from (REDUCE on a memoized tuple);
//! - a dict keeps a hash index of its string and integer keys (a SETITEMS is O(1), not a scan);
//! - dropping a value is iterative: a million nested tuples (two bytes each) would otherwise
//!   recurse a million frames deep in `drop` and overflow the stack.
//!
//! Lists, dicts and objects are shared through the memo exactly as in Python (a later `BINGET`
//! sees the items added after the `BINPUT`), hence `Rc<RefCell<…>>`. Cycles are possible (a
//! list appended to itself); they are leaked, which the input's size bounds.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

pub type Shared<T> = Rc<RefCell<T>>;

/// A call that Python would have made: `module.name(*args)`, then `BUILD` state and items.
#[derive(Debug, Default)]
pub struct Object {
    pub module: String,
    pub name: String,
    pub args: Rc<Vec<Value>>,
    pub state: Option<Value>,
}

/// Python's key equality for the keys state dicts use: strings and ints (other keys never
/// compare equal, so a repeated one is kept twice; nothing genslm reads has such keys).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Str(Rc<str>),
    Int(i64),
}

impl Key {
    fn of(v: &Value) -> Option<Key> {
        match v {
            Value::Str(s) => Some(Key::Str(s.clone())),
            Value::Int(i) => Some(Key::Int(*i)),
            _ => None,
        }
    }
}

/// A dict in insertion order, with an index of its hashable keys.
#[derive(Debug, Default)]
pub struct Dict {
    pairs: Vec<(Value, Value)>,
    index: HashMap<Key, usize>,
}

impl Dict {
    /// Python keeps the last value of a repeated key, in its first place.
    pub fn insert(&mut self, k: Value, v: Value) {
        match Key::of(&k) {
            Some(key) => match self.index.get(&key) {
                Some(&i) => self.pairs[i].1 = v,
                None => {
                    self.index.insert(key, self.pairs.len());
                    self.pairs.push((k, v));
                }
            },
            None => self.pairs.push((k, v)),
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = &(Value, Value)> {
        self.pairs.iter()
    }

    pub fn pairs(&self) -> &[(Value, Value)] {
        &self.pairs
    }

    /// The value under a string key.
    pub fn get(&self, k: &str) -> Option<&Value> {
        let i = *self.index.get(&Key::Str(Rc::from(k)))?;
        Some(&self.pairs[i].1)
    }
}

#[derive(Debug, Clone)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Tuple(Rc<Vec<Value>>),
    List(Shared<Vec<Value>>),
    Dict(Shared<Dict>),
    /// A reference to a global (`module.name`) that has not been called.
    Global(Rc<(String, String)>),
    Object(Shared<Object>),
    /// A persistent id: the pickle's reference to data stored outside it (torch: a storage).
    PersId(Rc<Value>),
    /// Internal: the stack marker.
    Mark,
}

impl Value {
    pub fn str(s: impl Into<Rc<str>>) -> Value {
        Value::Str(s.into())
    }
    pub fn dict() -> Value {
        Value::Dict(Rc::default())
    }
    pub fn list(v: Vec<Value>) -> Value {
        Value::List(Rc::new(RefCell::new(v)))
    }
    pub fn tuple(v: Vec<Value>) -> Value {
        Value::Tuple(Rc::new(v))
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }
    /// How many items a tuple or list holds (without copying them).
    pub fn item_count(&self) -> Option<usize> {
        match self {
            Value::Tuple(t) => Some(t.len()),
            Value::List(l) => Some(l.borrow().len()),
            _ => None,
        }
    }
    /// Items of a tuple or list.
    pub fn items(&self) -> Option<Vec<Value>> {
        match self {
            Value::Tuple(t) => Some(t.to_vec()),
            Value::List(l) => Some(l.borrow().clone()),
            _ => None,
        }
    }
    /// What the value is, for error messages.
    pub fn kind(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool(_) => "a bool".into(),
            Value::Int(_) => "an int".into(),
            Value::Float(_) => "a float".into(),
            Value::Str(_) => "a string".into(),
            Value::Bytes(_) => "bytes".into(),
            Value::Tuple(_) => "a tuple".into(),
            Value::List(_) => "a list".into(),
            Value::Dict(_) => "a dict".into(),
            Value::Global(g) => format!("the global {}.{}", g.0, g.1),
            Value::Object(o) => {
                let o = o.borrow();
                format!("a Python object {}.{}", o.module, o.name)
            }
            Value::PersId(_) => "a persistent reference".into(),
            Value::Mark => "a mark".into(),
        }
    }

    /// Moves the children of a container this is the last reference to into `work`, leaving
    /// it empty, so that dropping it recurses no further.
    fn give_children(&mut self, work: &mut Vec<Value>) {
        match self {
            Value::Tuple(t) => {
                if let Some(items) = Rc::get_mut(t) {
                    work.append(items);
                }
            }
            Value::List(l) => {
                if let Some(items) = Rc::get_mut(l) {
                    work.append(items.get_mut());
                }
            }
            Value::Dict(d) => {
                if let Some(d) = Rc::get_mut(d) {
                    let d = d.get_mut();
                    d.index.clear();
                    for (k, v) in d.pairs.drain(..) {
                        work.push(k);
                        work.push(v);
                    }
                }
            }
            Value::Object(o) => {
                if let Some(o) = Rc::get_mut(o) {
                    let o = o.get_mut();
                    if let Some(args) = Rc::get_mut(&mut o.args) {
                        work.append(args);
                    }
                    work.extend(o.state.take());
                }
            }
            Value::PersId(p) => {
                if let Some(inner) = Rc::get_mut(p) {
                    work.push(std::mem::replace(inner, Value::None));
                }
            }
            _ => {}
        }
    }
}

impl Drop for Value {
    fn drop(&mut self) {
        let mut work = Vec::new();
        self.give_children(&mut work);
        // Each value popped here has its children taken before it drops, so its own `drop`
        // finds nothing to do: the depth of the recursion is one, whatever the nesting.
        while let Some(mut v) = work.pop() {
            v.give_children(&mut work);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_deep_nesting_does_not_recurse() {
        // A million levels of every container kind: recursive drops would need tens of MiB of
        // stack (a test thread has 2 MiB, the main thread 8) and abort.
        let mut v = Value::None;
        for i in 0..1_000_000u32 {
            v = match i % 5 {
                0 => Value::tuple(vec![v]),
                1 => Value::list(vec![Value::Int(1), v]),
                2 => {
                    let d = Value::dict();
                    if let Value::Dict(dd) = &d {
                        dd.borrow_mut().insert(Value::str("k"), v);
                    }
                    d
                }
                3 => Value::Object(Rc::new(RefCell::new(Object {
                    args: Rc::new(vec![v]),
                    ..Default::default()
                }))),
                _ => Value::PersId(Rc::new(v)),
            };
        }
        drop(v);
    }

    #[test]
    fn shared_children_survive_the_drop_of_a_parent() {
        let inner = Value::list(vec![Value::Int(7)]);
        drop(Value::tuple(vec![
            inner.clone(),
            Value::tuple(vec![inner.clone()]),
        ]));
        assert_eq!(inner.items().unwrap()[0].as_int(), Some(7));
    }

    #[test]
    fn a_repeated_key_keeps_its_first_place_and_last_value() {
        // Python: d = {}; d['a'] = 1; d['b'] = 2; d['a'] = 3 -> {'a': 3, 'b': 2}
        let mut d = Dict::default();
        d.insert(Value::str("a"), Value::Int(1));
        d.insert(Value::str("b"), Value::Int(2));
        d.insert(Value::str("a"), Value::Int(3));
        d.insert(Value::Int(5), Value::Int(4));
        d.insert(Value::Int(5), Value::Int(6));
        let got: Vec<(String, i64)> = d
            .iter()
            .map(|(k, v)| {
                let k = k
                    .as_str()
                    .map_or_else(|| k.as_int().unwrap().to_string(), String::from);
                (k, v.as_int().unwrap())
            })
            .collect();
        assert_eq!(got, [("a".into(), 3), ("b".into(), 2), ("5".into(), 6)]);
        assert_eq!(d.get("a").and_then(Value::as_int), Some(3));
        assert!(d.get("c").is_none());
    }
}
