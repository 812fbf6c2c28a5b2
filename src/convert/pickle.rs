//! A pickle reader that never runs code. Python's unpickler imports whatever module a pickle
//! names and calls it, which is why a downloaded `.pt` can execute anything. This one builds
//! only data: numbers, strings, bytes, lists, tuples, dicts, and — for everything that would be
//! a call — an inert [`Object`] recording which global it names and the arguments it would get.
//! The caller decides what those mean (torch.rs turns `_rebuild_tensor_v2` records into
//! tensors) and everything else stays an opaque record.
//!
//!
//! What it builds, and why a hostile file cannot make that cost more than its size: [`value`].

pub use super::value::{Object, Value};
use std::cell::RefCell;
use std::rc::Rc;

struct Vm<'a> {
    data: &'a [u8],
    at: usize,
    stack: Vec<Value>,
    memo: std::collections::HashMap<u64, Value>,
    /// Opcodes run so far (see [`MAX_OPS`]).
    ops: usize,
}

/// Opcodes a pickle may run. Each builds at most one value, but a value costs up to ~160 bytes
/// (a one-byte EMPTY_LIST is a shared, growable list in its parent): a 4 MB pickle of empty
/// lists took 637 MB. Checkpoints' object graphs are small — GenSLM's 25M Lightning checkpoint
/// (weights and Adam moments) is 9.5 KB of pickle, ~30 opcodes a tensor — so 2²¹ opcodes,
/// room for ~70,000 tensors, bound the reader at ~330 MB whatever the file.
pub const MAX_OPS: usize = 1 << 21;

impl<'a> Vm<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or_else(|| format!("ends inside an opcode at byte {}", self.at))?;
        let s = &self.data[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn uint(&mut self, n: usize) -> Result<u64, String> {
        let b = self.take(n)?;
        Ok(b.iter().rev().fold(0u64, |acc, &x| (acc << 8) | x as u64))
    }
    fn line(&mut self) -> Result<&'a str, String> {
        let rest = &self.data[self.at..];
        let n = rest
            .iter()
            .position(|&c| c == b'\n')
            .ok_or("a text opcode has no end of line")?;
        let s = std::str::from_utf8(&rest[..n]).map_err(|_| "a text opcode is not UTF-8")?;
        self.at += n + 1;
        Ok(s)
    }
    fn pop(&mut self) -> Result<Value, String> {
        self.stack.pop().ok_or_else(|| "pops an empty stack".into())
    }
    fn top(&mut self) -> Result<&mut Value, String> {
        self.stack
            .last_mut()
            .ok_or_else(|| "reads an empty stack".into())
    }
    /// Everything above the topmost mark (the mark is removed).
    fn pop_mark(&mut self) -> Result<Vec<Value>, String> {
        let m = self
            .stack
            .iter()
            .rposition(|v| matches!(v, Value::Mark))
            .ok_or("no mark on the stack")?;
        let items = self.stack.split_off(m + 1);
        self.stack.pop();
        Ok(items)
    }
    fn text(&mut self, n: usize) -> Result<String, String> {
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| "a string is not UTF-8".into())
    }
    fn memo_get(&self, i: u64) -> Result<Value, String> {
        self.memo
            .get(&i)
            .cloned()
            .ok_or_else(|| format!("memo entry {i} was never stored"))
    }
    fn memo_put(&mut self, i: u64) -> Result<(), String> {
        let v = self
            .stack
            .last()
            .cloned()
            .ok_or("memoizes an empty stack")?;
        self.memo.insert(i, v);
        Ok(())
    }

    /// What calling `callable(*args)` yields: plain containers for the few harmless
    /// constructors pickles use for them, an inert record for anything else.
    /// The arguments are the tuple the pickle built, shared, not copied: a memoized tuple
    /// passed to a thousand calls is one tuple. Like Python, anything else is refused.
    fn call(callable: Value, args: Value) -> Result<Value, String> {
        let (module, name) = match &callable {
            Value::Global(g) => (g.0.clone(), g.1.clone()),
            other => return Err(format!("calls {}, which is not a global", other.kind())),
        };
        let args = match &args {
            Value::Tuple(t) => t.clone(),
            other => return Err(format!("call arguments are {}, not a tuple", other.kind())),
        };
        let v = match (module.as_str(), name.as_str(), args.as_slice()) {
            ("collections", "OrderedDict", []) | ("builtins", "dict", []) => Value::dict(),
            ("builtins", "list", []) => Value::list(Vec::new()),
            _ => Value::Object(Rc::new(RefCell::new(Object {
                module,
                name,
                args,
                state: None,
            }))),
        };
        Ok(v)
    }

    fn set_items(target: &Value, items: Vec<Value>) -> Result<(), String> {
        if !items.len().is_multiple_of(2) {
            return Err("SETITEMS with an odd number of items".into());
        }
        let mut it = items.into_iter();
        match target {
            Value::Dict(d) => {
                let mut d = d.borrow_mut();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.insert(k, v);
                }
                Ok(())
            }
            // A dict subclass (defaultdict, ...) outside the tensors: its items are not needed.
            Value::Object(_) => Ok(()),
            other => Err(format!("sets items on {}", other.kind())),
        }
    }

    fn append(target: &Value, items: Vec<Value>) -> Result<(), String> {
        match target {
            Value::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            Value::Object(_) => Ok(()),
            other => Err(format!("appends to {}", other.kind())),
        }
    }

    fn run(&mut self) -> Result<Value, String> {
        loop {
            self.ops += 1;
            if self.ops > MAX_OPS {
                return Err(format!(
                    "runs more than {MAX_OPS} operations (a checkpoint's object graph takes a few \
                     thousand, ~30 per tensor: room for ~70,000 tensors): not a state dict \
                     genslm reads"
                ));
            }
            let op = self.take(1)?[0];
            match op {
                0x80 => {
                    let p = self.uint(1)?;
                    if p > 5 {
                        return Err(format!("pickle protocol {p} is newer than 5"));
                    }
                }
                0x95 => drop(self.uint(8)?), // FRAME: a length hint only
                b'.' => return self.pop(),
                b'(' => self.stack.push(Value::Mark),
                b'0' => drop(self.pop()?),
                b'1' => drop(self.pop_mark()?),
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v)
                }
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'K' => {
                    let v = self.uint(1)? as i64;
                    self.stack.push(Value::Int(v))
                }
                b'M' => {
                    let v = self.uint(2)? as i64;
                    self.stack.push(Value::Int(v))
                }
                b'J' => {
                    let v = self.uint(4)? as u32 as i32 as i64;
                    self.stack.push(Value::Int(v))
                }
                0x8a | 0x8b => {
                    let n = self.uint(if op == 0x8a { 1 } else { 4 })? as usize;
                    let b = self.take(n)?;
                    self.stack.push(long(b)?)
                }
                b'I' | b'L' => {
                    let s = self.line()?.trim_end_matches('L');
                    let v = match s {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        _ => Value::Int(s.parse().map_err(|_| format!("bad integer '{s}'"))?),
                    };
                    self.stack.push(v)
                }
                b'G' => {
                    let b = self.take(8)?;
                    self.stack
                        .push(Value::Float(f64::from_be_bytes(b.try_into().unwrap())))
                }
                b'F' => {
                    let s = self.line()?;
                    let f = s.parse().map_err(|_| format!("bad float '{s}'"))?;
                    self.stack.push(Value::Float(f))
                }
                b'X' | 0x8c | 0x8d | b'T' | b'U' => {
                    let n = match op {
                        0x8c | b'U' => self.uint(1)?,
                        0x8d => self.uint(8)?,
                        _ => self.uint(4)?,
                    } as usize;
                    let s = self.text(n)?;
                    self.stack.push(Value::str(s))
                }
                b'V' | b'S' => {
                    let s = self.line()?.trim_matches(|c| c == '\'' || c == '"');
                    self.stack.push(Value::str(s))
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'C' => self.uint(1)?,
                        b'B' => self.uint(4)?,
                        _ => self.uint(8)?,
                    } as usize;
                    let b = self.take(n)?;
                    self.stack.push(Value::Bytes(b.into()))
                }
                b']' => self.stack.push(Value::list(Vec::new())),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::list(items))
                }
                b'a' => {
                    let v = self.pop()?;
                    Self::append(self.top()?, vec![v])?
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    Self::append(self.top()?, items)?
                }
                b')' => self.stack.push(Value::tuple(Vec::new())),
                b't' => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::tuple(items))
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    if self.stack.len() < n {
                        return Err("a tuple opcode pops an empty stack".into());
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::tuple(items))
                }
                b'}' => self.stack.push(Value::dict()),
                b'd' => {
                    let items = self.pop_mark()?;
                    let d = Value::dict();
                    Self::set_items(&d, items)?;
                    self.stack.push(d)
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    Self::set_items(self.top()?, vec![k, v])?
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    Self::set_items(self.top()?, items)?
                }
                // Sets: only their members matter, kept as a list.
                0x8f => self.stack.push(Value::list(Vec::new())),
                0x90 => {
                    let items = self.pop_mark()?;
                    Self::append(self.top()?, items)?
                }
                0x91 => {
                    let items = self.pop_mark()?;
                    self.stack.push(Value::list(items))
                }
                b'c' => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    self.stack.push(Value::Global(Rc::new((module, name))))
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (&module, &name) {
                        (Value::Str(m), Value::Str(n)) => self
                            .stack
                            .push(Value::Global(Rc::new((m.to_string(), n.to_string())))),
                        _ => return Err("STACK_GLOBAL without two strings".into()),
                    }
                }
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.stack.push(Self::call(callable, args)?)
                }
                0x92 => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    self.stack.push(Self::call(callable, args)?)
                }
                b'b' => {
                    let state = self.pop()?;
                    match self.top()? {
                        Value::Object(o) => o.borrow_mut().state = Some(state),
                        // An OrderedDict with attributes (a state_dict's `_metadata`):
                        // the attributes are not part of the mapping.
                        Value::Dict(_) | Value::List(_) => {}
                        other => return Err(format!("BUILD on {}", other.kind())),
                    }
                }
                b'P' => {
                    let pid = self.line()?.to_string();
                    self.stack.push(Value::PersId(Rc::new(Value::str(pid))))
                }
                b'Q' => {
                    let pid = self.pop()?;
                    self.stack.push(Value::PersId(Rc::new(pid)))
                }
                b'p' => {
                    let i = self.line()?.parse().map_err(|_| "bad PUT index")?;
                    self.memo_put(i)?
                }
                b'q' | b'r' => {
                    let i = self.uint(if op == b'q' { 1 } else { 4 })?;
                    self.memo_put(i)?
                }
                0x94 => {
                    let i = self.memo.len() as u64;
                    self.memo_put(i)?
                }
                b'g' => {
                    let i = self.line()?.parse().map_err(|_| "bad GET index")?;
                    let v = self.memo_get(i)?;
                    self.stack.push(v)
                }
                b'h' | b'j' => {
                    let i = self.uint(if op == b'h' { 1 } else { 4 })?;
                    let v = self.memo_get(i)?;
                    self.stack.push(v)
                }
                other => {
                    return Err(format!(
                        "opcode 0x{other:02x} at byte {} is not supported (extension registry, \
                         out-of-band buffers or old-style instances)",
                        self.at - 1
                    ))
                }
            }
        }
    }
}

/// LONG1/LONG4: little-endian two's complement of any length; genslm needs no more than i64.
fn long(b: &[u8]) -> Result<Value, String> {
    if b.is_empty() {
        return Ok(Value::Int(0));
    }
    if b.len() > 8 {
        return Err(format!(
            "an integer of {} bytes does not fit 64 bits",
            b.len()
        ));
    }
    let neg = b[b.len() - 1] & 0x80 != 0;
    let mut buf = [if neg { 0xff } else { 0 }; 8];
    buf[..b.len()].copy_from_slice(b);
    Ok(Value::Int(i64::from_le_bytes(buf)))
}

/// Runs the pickle in `data` and returns the value it builds. Nothing is imported or called.
pub fn load(data: &[u8]) -> Result<Value, String> {
    let mut vm = Vm {
        data,
        at: 0,
        stack: Vec::new(),
        memo: Default::default(),
        ops: 0,
    };
    vm.run()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Bytes printed by CPython 3.11's `pickle.dumps`, so the reader is checked against
    // Python's own encoder.
    #[test]
    fn reads_python_protocol_2() {
        // pickle.dumps({'a': [1, -2, 300, 2**40], 'b': (None, True, 1.5)}, protocol=2)
        let p: &[u8] = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01\x8a\x06\x00\x00\x00\x00\x00\x01eX\x01\x00\x00\x00bq\x03N\x88G?\xf8\x00\x00\x00\x00\x00\x00\x87q\x04u.";
        let v = load(p).unwrap();
        let Value::Dict(d) = &v else { panic!("{v:?}") };
        let d = d.borrow();
        let d = d.pairs();
        assert_eq!(d[0].0.as_str(), Some("a"));
        let a: Vec<i64> = d[0]
            .1
            .items()
            .unwrap()
            .iter()
            .map(|x| x.as_int().unwrap())
            .collect();
        assert_eq!(a, vec![1, -2, 300, 1 << 40]);
        let b = d[1].1.items().unwrap();
        assert!(matches!(b[0], Value::None));
        assert!(matches!(b[1], Value::Bool(true)));
        assert!(matches!(b[2], Value::Float(f) if f == 1.5));
    }

    #[test]
    fn reads_python_protocol_4() {
        // pickle.dumps({'k': [1.5, 'é', b'\x00\x01', {2, 3}]}, protocol=4) (then `K\x00` for 0)
        let p: &[u8] = b"\x80\x04\x95)\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01k\x94]\x94(G?\xf8\x00\x00\x00\x00\x00\x00\x8c\x02\xc3\xa9\x94C\x02\x00\x01\x94\x8f\x94(K\x02K\x03\x90K\x00es.";
        let v = load(p).unwrap();
        let Value::Dict(d) = &v else { panic!() };
        let d = d.borrow();
        let d = d.pairs();
        assert_eq!(d[0].0.as_str(), Some("k"));
        let k = d[0].1.items().unwrap();
        assert_eq!(k[1].as_str(), Some("é"));
        assert!(matches!(&k[2], Value::Bytes(b) if b[..] == [0, 1]));
        let set: Vec<i64> = k[3]
            .items()
            .unwrap()
            .iter()
            .map(|x| x.as_int().unwrap())
            .collect();
        assert_eq!(set, vec![2, 3]);
        assert_eq!(k[4].as_int(), Some(0));
    }

    #[test]
    fn a_global_call_is_recorded_not_run() {
        // An object whose __reduce__ returns (os.system, ('x',)): Python would run `x`.
        let p: &[u8] = b"\x80\x02cposix\nsystem\nq\x00X\x01\x00\x00\x00xq\x01\x85q\x02Rq\x03.";
        let v = load(p).unwrap();
        let Value::Object(o) = &v else { panic!() };
        let o = o.borrow();
        assert_eq!((o.module.as_str(), o.name.as_str()), ("posix", "system"));
        assert_eq!(o.args[0].as_str(), Some("x"));
    }

    #[test]
    fn shared_containers_are_one_object() {
        // x = [7]; pickle.dumps([x, x], protocol=2): the second item is a memo reference.
        let p: &[u8] = b"\x80\x02]q\x00(]q\x01K\x07ah\x01e.";
        let v = load(p).unwrap();
        let Value::List(outer) = &v else { panic!() };
        let outer = outer.borrow();
        let (Value::List(a), Value::List(b)) = (&outer[0], &outer[1]) else {
            panic!()
        };
        assert_eq!(b.borrow()[0].as_int(), Some(7));
        a.borrow_mut().push(Value::Int(8));
        assert_eq!(b.borrow().len(), 2, "one list, two references");
    }

    /// Protocol 2 framing around `body`, which must leave one value on the stack.
    fn pickle(body: &[u8]) -> Vec<u8> {
        [&b"\x80\x02"[..], body, b"."].concat()
    }

    #[test]
    fn two_million_nested_tuples_load_and_drop() {
        // `()` then TUPLE1 two million times: a 2 MB file whose value is nested two million
        // deep (Python itself refuses it: RecursionError when it is used).
        let n = 2_000_000;
        let mut body = vec![b')'];
        body.resize(1 + n, 0x85);
        let v = load(&pickle(&body)).unwrap();
        let (mut depth, mut at) = (0, v.clone());
        while let Some(items) = at.items() {
            match items.first() {
                Some(inner) => (depth, at) = (depth + 1, inner.clone()),
                None => break,
            }
        }
        assert_eq!(depth, n);
    }

    /// One byte per empty list, ~160 bytes per list built: past MAX_OPS opcodes the pickle is
    /// refused instead of taking 160 times its size (4 MB took 637 MB).
    #[test]
    fn a_pickle_of_more_operations_than_the_bound_is_refused() {
        let mut body = b"(".to_vec();
        body.resize(1 + MAX_OPS, b']');
        body.push(b'l');
        let err = load(&pickle(&body)).unwrap_err();
        assert!(
            err.contains(&format!("more than {MAX_OPS} operations")),
            "{err}"
        );
        // Just under the bound it loads, as a real checkpoint of that size would.
        let mut body = b"(".to_vec();
        body.resize(MAX_OPS - 4, b']');
        body.push(b'l');
        assert_eq!(
            load(&pickle(&body)).unwrap().items().unwrap().len(),
            MAX_OPS - 5
        );
    }

    #[test]
    fn calls_share_a_memoized_argument_tuple() {
        // t = tuple(range 20k); 50k calls f(*t): copied per call that is 10^9 values (32 GB).
        let mut body = b"cm\nf\nq\x00(".to_vec();
        for _ in 0..20_000 {
            body.extend_from_slice(b"K\x01");
        }
        body.extend_from_slice(b"tq\x01");
        for _ in 0..50_000 {
            body.extend_from_slice(b"h\x00h\x01R0");
        }
        body.extend_from_slice(b"](h\x00h\x01Rh\x00h\x01Re");
        let v = load(&pickle(&body)).unwrap();
        let calls = v.items().unwrap();
        let (Value::Object(a), Value::Object(b)) = (&calls[0], &calls[1]) else {
            panic!()
        };
        let (a, b) = (a.borrow(), b.borrow());
        assert_eq!((a.module.as_str(), a.name.as_str()), ("m", "f"));
        assert_eq!(a.args.len(), 20_000);
        assert!(
            Rc::ptr_eq(&a.args, &b.args),
            "two calls, one argument tuple"
        );
        // Python refuses arguments that are not a tuple; so does this reader.
        let err = load(&pickle(b"cm\nf\n]R")).unwrap_err();
        assert!(err.contains("not a tuple"), "{err}");
    }

    #[test]
    fn many_setitems_keep_pythons_dict_semantics() {
        // 200k distinct keys set one SETITEM at a time, then the first 1000 again: what Python
        // builds is {k0: 1, ..., k199999: 0} with k0..k999 set to 1 in their first places.
        let mut body = b"}".to_vec();
        let key = |i: u32| format!("k{i:07}");
        for (i, v) in (0..200_000u32)
            .map(|i| (i, 0u8))
            .chain((0..1000).map(|i| (i, 1)))
        {
            body.push(b'X');
            body.extend_from_slice(&8u32.to_le_bytes());
            body.extend_from_slice(key(i).as_bytes());
            body.extend_from_slice(&[b'K', v, b's']);
        }
        let v = load(&pickle(&body)).unwrap();
        let Value::Dict(d) = &v else { panic!() };
        let d = d.borrow();
        assert_eq!(d.pairs().len(), 200_000);
        for (i, (k, v)) in d.iter().enumerate() {
            assert_eq!(k.as_str(), Some(key(i as u32).as_str()));
            assert_eq!(v.as_int(), Some((i < 1000) as i64));
        }
    }

    #[test]
    fn damaged_pickles_are_errors_not_panics() {
        for p in [
            &b""[..],
            b"\x80\x02",
            b"\x80\x02X\xff\xff\x00\x00ab.",
            b"\x80\x02h\x05.",
            b"\x80\x02u.",
            b"\x80\x09N.",
        ] {
            assert!(load(p).is_err(), "{p:?}");
        }
    }
}
