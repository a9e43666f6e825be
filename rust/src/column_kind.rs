//! The kinds of input column types, and reading values through them: the rule by which the
//! reader checks a column's type, compares one file's type with another's and reads a value
//! (`validate` and `run` check inputs through it before any model loads: reader/validate.rs).
//!
//! Writers spell one logical type several ways: pyarrow and duckdb write `string`, polars
//! `large_string`, some `string_view`; pandas `category`, polars `Categorical` and
//! `dictionary_encode()` write dictionaries. So:
//! - a dictionary-encoded column is judged and read by its values (`dense`): a dictionary of
//!   strings is a string column wherever one is expected, also inside a list or a struct;
//! - a column whose type differs between files has one output type when both are of one kind
//!   (`unified`): strings of any spelling (and dictionaries of them) become LargeUtf8,
//!   integers of any width (and dictionaries of them) Int64, but UInt64 mixes with no other
//!   type (Int64 cannot hold its values); `conform` converts a file's array to that type.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::builder::{Int64Builder, StringViewBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{
    Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type,
};
use arrow_array::{Array, ArrayRef, LargeStringArray, StringArray};
use arrow_schema::DataType;

use crate::error::Error;

/// How the rule for mixing types across files reads in messages.
pub const MIXING_RULE: &str = "types of one kind mix (string, large_string, string_view and \
     their dictionaries as large_string; integers of any width as int64, but uint64 only with \
     uint64)";

/// A dictionary-encoded type's value type; any other type itself.
pub fn dense_type(dt: &DataType) -> &DataType {
    match dt {
        DataType::Dictionary(_, v) => v.as_ref(),
        _ => dt,
    }
}

/// A string type (Utf8, LargeUtf8, Utf8View), or a dictionary of one.
pub fn is_text(dt: &DataType) -> bool {
    matches!(
        dense_type(dt),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

/// An integer type of any width, signed or unsigned, or a dictionary of one.
pub fn is_int(dt: &DataType) -> bool {
    use DataType as D;
    matches!(
        dense_type(dt),
        D::Int8 | D::Int16 | D::Int32 | D::Int64 | D::UInt8 | D::UInt16 | D::UInt32 | D::UInt64
    )
}

/// A list or large list whose item type passes `item`.
pub fn is_list_of(dt: &DataType, item: impl Fn(&DataType) -> bool) -> bool {
    matches!(dt, DataType::List(f) | DataType::LargeList(f) if item(f.data_type()))
}

/// The one output type of a column of type `a` in one file and `b` in another (see the module
/// header), or None when they are of different kinds.
pub fn unified(a: &DataType, b: &DataType) -> Option<DataType> {
    let uint64 = |t: &DataType| *dense_type(t) == DataType::UInt64;
    if a == b {
        Some(a.clone())
    } else if is_text(a) && is_text(b) {
        Some(DataType::LargeUtf8)
    } else if is_int(a) && is_int(b) && !uint64(a) && !uint64(b) {
        Some(DataType::Int64)
    } else {
        None
    }
}

/// The output type of each column written from the input, over the files seen so far
/// (`unified`).
#[derive(Debug, Default)]
pub struct FileTypes {
    /// column -> (unified type so far, the first file's type, the first file)
    seen: BTreeMap<String, (DataType, DataType, PathBuf)>,
}

impl FileTypes {
    /// Records `column`'s type `dt` in file `path`; a type of another kind than an earlier
    /// file's is a user error naming the key, the column and both files.
    pub fn add(
        &mut self,
        key: &str,
        column: &str,
        dt: &DataType,
        path: &Path,
    ) -> crate::error::Result<()> {
        let Some((out, first, first_path)) = self.seen.get_mut(column) else {
            let entry = (dt.clone(), dt.clone(), path.to_path_buf());
            self.seen.insert(column.to_string(), entry);
            return Ok(());
        };
        match unified(out, dt) {
            Some(both) => *out = both,
            None => {
                return Err(Error::user(format!(
                    "{key}: column '{column}' has type {} in {} but {} in {}; the \
                     output column has one type, so every input file must agree: {MIXING_RULE}",
                    type_name(first),
                    first_path.display(),
                    type_name(dt),
                    path.display()
                )))
            }
        }
        Ok(())
    }

    /// The type `column` is written as (None before any file recorded it).
    pub fn output_type(&self, column: &str) -> Option<DataType> {
        self.seen.get(column).map(|(t, _, _)| t.clone())
    }
}

/// `dt` as pyarrow spells it (`string`, `int64`, `list<item: string>`, `dictionary<values=
/// string, indices=int8, ordered=0>`): the names a user sees where the file was written.
pub fn type_name(dt: &DataType) -> String {
    use DataType as D;
    let item = |f: &arrow_schema::Field| format!("{}: {}", f.name(), type_name(f.data_type()));
    match dt {
        D::Utf8 => "string".into(),
        D::LargeUtf8 => "large_string".into(),
        D::Utf8View => "string_view".into(),
        D::Boolean => "bool".into(),
        D::Float16 => "halffloat".into(),
        D::Float32 => "float".into(),
        D::Float64 => "double".into(),
        D::Binary => "binary".into(),
        D::LargeBinary => "large_binary".into(),
        D::Null => "null".into(),
        D::List(f) => format!("list<{}>", item(f)),
        D::LargeList(f) => format!("large_list<{}>", item(f)),
        D::Struct(fields) => {
            let items: Vec<String> = fields.iter().map(|f| item(f)).collect();
            format!("struct<{}>", items.join(", "))
        }
        D::Dictionary(k, v) => format!(
            "dictionary<values={}, indices={}, ordered=0>",
            type_name(v),
            type_name(k)
        ),
        _ => dt.to_string().to_lowercase(),
    }
}

/// Row `i` of an integer array of any width, widened (None when null or not an integer).
pub fn int_value(a: &dyn Array, i: usize) -> Option<i128> {
    if a.is_null(i) {
        return None;
    }
    macro_rules! get {
        ($t:ty) => {
            Some(a.as_primitive::<$t>().value(i) as i128)
        };
    }
    match a.data_type() {
        DataType::Int8 => get!(Int8Type),
        DataType::Int16 => get!(Int16Type),
        DataType::Int32 => get!(Int32Type),
        DataType::Int64 => get!(Int64Type),
        DataType::UInt8 => get!(UInt8Type),
        DataType::UInt16 => get!(UInt16Type),
        DataType::UInt32 => get!(UInt32Type),
        DataType::UInt64 => get!(UInt64Type),
        _ => None,
    }
}

/// Row `i` of `a` with a dictionary looked through: the array holding its value and the
/// value's index there (None when the row's key is null or out of the dictionary).
pub fn dense(a: &dyn Array, i: usize) -> Option<(&dyn Array, usize)> {
    let Some(dict) = a.as_any_dictionary_opt() else {
        return Some((a, i));
    };
    let key = usize::try_from(int_value(dict.keys(), i)?).ok()?;
    let values = dict.values().as_ref();
    (key < values.len() && values.is_valid(key)).then_some((values, key))
}

/// The string at `i` of a string array or a dictionary of strings (None when null or not a
/// string).
pub fn str_value(a: &dyn Array, i: usize) -> Option<&str> {
    let (a, i) = dense(a, i)?;
    if a.is_null(i) {
        return None;
    }
    match a.data_type() {
        DataType::Utf8 => Some(a.as_string::<i32>().value(i)),
        DataType::LargeUtf8 => Some(a.as_string::<i64>().value(i)),
        DataType::Utf8View => Some(a.as_string_view().value(i)),
        _ => None,
    }
}

/// `a` as an array of type `target`, which `unified` chose for `a`'s type and others (or a
/// dictionary's value type, to decode it): the same values, nulls kept. Other targets are an
/// internal error (the schema checks allowed no such pair).
pub fn conform(a: &ArrayRef, target: &DataType) -> Result<ArrayRef, String> {
    if a.data_type() == target {
        return Ok(a.clone());
    }
    let rows = 0..a.len();
    let out: ArrayRef = match target {
        DataType::Utf8 if is_text(a.data_type()) => Arc::new(
            rows.map(|i| str_value(a.as_ref(), i))
                .collect::<StringArray>(),
        ),
        DataType::LargeUtf8 if is_text(a.data_type()) => Arc::new(
            rows.map(|i| str_value(a.as_ref(), i))
                .collect::<LargeStringArray>(),
        ),
        DataType::Utf8View if is_text(a.data_type()) => {
            let mut b = StringViewBuilder::with_capacity(a.len());
            rows.for_each(|i| b.append_option(str_value(a.as_ref(), i)));
            Arc::new(b.finish())
        }
        DataType::Int64 if is_int(a.data_type()) => int64_array(a.as_ref())?,
        _ if dense_type(a.data_type()) == target => decode(a)?,
        _ => {
            return Err(format!(
                "internal: cannot read a {} column as {target}",
                a.data_type()
            ))
        }
    };
    Ok(out)
}

/// An integer array (or a dictionary of one) as Int64; a value out of its range is an error.
fn int64_array(a: &dyn Array) -> Result<ArrayRef, String> {
    let mut b = Int64Builder::with_capacity(a.len());
    for i in 0..a.len() {
        let v = dense(a, i).and_then(|(values, j)| int_value(values, j));
        let v = v
            .map(|v| i64::try_from(v).map_err(|_| format!("{v} does not fit an int64")))
            .transpose()?;
        b.append_option(v);
    }
    Ok(Arc::new(b.finish()))
}

/// A dictionary array as an array of its value type (the values taken by the keys).
fn decode(a: &ArrayRef) -> Result<ArrayRef, String> {
    let dict = a
        .as_any_dictionary_opt()
        .ok_or_else(|| format!("internal: {} is no dictionary", a.data_type()))?;
    arrow_select::take::take(dict.values().as_ref(), dict.keys(), None).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::types::Int8Type as K8;
    use arrow_array::{DictionaryArray, Int32Array, UInt64Array};

    fn dict_strings(values: &[Option<&str>]) -> ArrayRef {
        Arc::new(values.iter().copied().collect::<DictionaryArray<K8>>())
    }

    #[test]
    fn dictionaries_are_judged_and_read_by_their_values() {
        let d = dict_strings(&[Some("b"), None, Some("a"), Some("b")]);
        assert!(is_text(d.data_type()) && !is_int(d.data_type()));
        let read: Vec<_> = (0..4).map(|i| str_value(d.as_ref(), i)).collect();
        assert_eq!(read, vec![Some("b"), None, Some("a"), Some("b")]);
        let ints = DictionaryArray::<K8>::new(
            arrow_array::Int8Array::from(vec![0, 0]),
            Arc::new(Int32Array::from(vec![7])),
        );
        assert!(is_int(ints.data_type()) && !is_text(ints.data_type()));
        assert_eq!(str_value(&ints, 0), None);
        let listed = DataType::List(Arc::new(arrow_schema::Field::new(
            "item",
            d.data_type().clone(),
            true,
        )));
        assert!(is_list_of(&listed, is_text));
    }

    #[test]
    fn types_are_named_as_pyarrow_names_them() {
        use DataType as D;
        let list = D::List(Arc::new(arrow_schema::Field::new("item", D::Utf8, true)));
        let dict = D::Dictionary(Box::new(D::Int8), Box::new(D::LargeUtf8));
        assert_eq!(type_name(&D::Int64), "int64");
        assert_eq!(type_name(&D::UInt64), "uint64");
        assert_eq!(type_name(&D::Float64), "double");
        assert_eq!(type_name(&list), "list<item: string>");
        let want = "dictionary<values=large_string, indices=int8, ordered=0>";
        assert_eq!(type_name(&dict), want);
    }

    #[test]
    fn types_of_one_kind_unify_and_others_do_not() {
        use DataType as D;
        let dict = |v: D| D::Dictionary(Box::new(D::Int32), Box::new(v));
        assert_eq!(unified(&D::Utf8, &D::Utf8), Some(D::Utf8));
        assert_eq!(unified(&D::Utf8, &D::LargeUtf8), Some(D::LargeUtf8));
        assert_eq!(unified(&D::Utf8View, &dict(D::Utf8)), Some(D::LargeUtf8));
        assert_eq!(unified(&D::Int32, &D::UInt8), Some(D::Int64));
        assert_eq!(unified(&D::UInt64, &D::UInt64), Some(D::UInt64));
        assert_eq!(unified(&D::UInt64, &D::Int64), None);
        assert_eq!(unified(&D::Int64, &D::Utf8), None);
        assert_eq!(unified(&D::Float32, &D::Float64), None);
    }

    #[test]
    fn conform_converts_to_the_unified_type_keeping_nulls() {
        let d = dict_strings(&[Some("x"), None, Some("y")]);
        let large = conform(&d, &DataType::LargeUtf8).unwrap();
        let want = LargeStringArray::from(vec![Some("x"), None, Some("y")]);
        assert_eq!(large.as_string::<i64>(), &want);
        let plain = conform(&d, &DataType::Utf8).unwrap();
        assert_eq!(
            plain.as_string::<i32>(),
            &StringArray::from(vec![Some("x"), None, Some("y")])
        );
        let ints: ArrayRef = Arc::new(Int32Array::from(vec![Some(-3), None]));
        let wide = conform(&ints, &DataType::Int64).unwrap();
        assert_eq!(wide.as_primitive::<Int64Type>().values(), &[-3, 0]);
        assert!(wide.is_null(1));
        let big: ArrayRef = Arc::new(UInt64Array::from(vec![u64::MAX]));
        assert!(conform(&big, &DataType::Int64).is_err());
        let same = conform(&big, &DataType::UInt64).unwrap();
        assert!(Arc::ptr_eq(&same, &big));
        assert!(conform(&ints, &DataType::Utf8).is_err());
    }
}
