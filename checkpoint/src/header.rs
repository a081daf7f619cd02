//! Reading and writing safetensors headers, with limits, without the safetensors crate's
//! whole-file view: files are streamed, so only the header is ever parsed here.
//!
//! A safetensors file is `u64 LE n`, then `n` bytes of UTF-8 JSON (the header), then the data
//! region. Every tensor's `data_offsets` are relative to the data region, and the tensors
//! tile it exactly: no gaps, no overlaps, nothing after the last one.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::error::{Error, Result};

/// The largest header this crate reads (the safetensors crate's own limit is 100 MB).
pub const HEADER_BYTES_MAX: u64 = 64 * 1024 * 1024;
/// The most tensors one header may list.
pub const TENSORS_PER_FILE_MAX: usize = 1_000_000;
/// The most dimensions one tensor may have.
pub const RANK_MAX: usize = 16;

/// One tensor as a header lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    /// `[begin, end)` in the data region.
    pub data_offsets: [u64; 2],
}

/// A parsed, validated header.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Header {
    /// Tensors in data order.
    pub tensors: Vec<HeaderTensor>,
    pub metadata: BTreeMap<String, String>,
    /// Length of the data region.
    pub data_bytes: u64,
}

/// Bytes per element of a safetensors dtype; `None` for dtypes this crate does not handle
/// (the sub-byte float formats).
pub fn dtype_size_bytes(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" | "C64" => 8,
        _ => return None,
    })
}

/// The byte-plane width worth trying for a dtype: floats whose exponent bytes compress well.
pub fn plane_width_for(dtype: &str) -> Option<u8> {
    match dtype {
        "F16" | "BF16" => Some(2),
        "F32" => Some(4),
        "F64" => Some(8),
        _ => None,
    }
}

/// `product(shape) * size(dtype)`, or an error naming the tensor on overflow/unknown dtype.
pub fn tensor_bytes(name: &str, dtype: &str, shape: &[u64]) -> std::result::Result<u64, String> {
    let size = dtype_size_bytes(dtype)
        .ok_or_else(|| format!("tensor {name:?}: unknown dtype {dtype:?}"))?;
    if shape.len() > RANK_MAX {
        return Err(format!(
            "tensor {name:?}: {} dimensions, over the limit of {RANK_MAX}",
            shape.len()
        ));
    }
    shape
        .iter()
        .try_fold(size, |acc, d| acc.checked_mul(*d))
        .ok_or_else(|| format!("tensor {name:?}: shape {shape:?} overflows"))
}

/// Reads the 8-byte length prefix and checks it against [`HEADER_BYTES_MAX`] and the file size.
pub fn header_len(prefix: [u8; 8], file: &str, file_bytes: u64) -> Result<u64> {
    let n = u64::from_le_bytes(prefix);
    if n > HEADER_BYTES_MAX {
        return Err(Error::InvalidSafetensors {
            file: file.to_string(),
            reason: format!("header of {n} bytes is over the limit of {HEADER_BYTES_MAX} bytes"),
        });
    }
    if n.checked_add(8).is_none_or(|end| end > file_bytes) {
        return Err(Error::InvalidSafetensors {
            file: file.to_string(),
            reason: format!("header of {n} bytes does not fit in a file of {file_bytes} bytes"),
        });
    }
    Ok(n)
}

/// Parses and validates header bytes (without the length prefix).
pub fn parse_header(bytes: &[u8], file: &str) -> Result<Header> {
    parse_inner(bytes).map_err(|reason| Error::InvalidSafetensors {
        file: file.to_string(),
        reason,
    })
}

fn parse_inner(bytes: &[u8]) -> std::result::Result<Header, String> {
    if bytes.len() as u64 > HEADER_BYTES_MAX {
        return Err(format!(
            "header of {} bytes is over the limit of {HEADER_BYTES_MAX} bytes",
            bytes.len()
        ));
    }
    let text = std::str::from_utf8(bytes).map_err(|e| format!("header is not UTF-8: {e}"))?;
    if !text.starts_with('{') {
        return Err("header does not start with '{'".into());
    }
    let value: Value = serde_json::from_str(text.trim_end_matches(' '))
        .map_err(|e| format!("header JSON: {e}"))?;
    let Value::Object(map) = value else {
        return Err("header is not a JSON object".into());
    };
    if map.len() > TENSORS_PER_FILE_MAX + 1 {
        return Err(format!(
            "header lists {} entries, over the limit of {TENSORS_PER_FILE_MAX}",
            map.len()
        ));
    }
    let mut header = Header::default();
    for (name, v) in map {
        if name == "__metadata__" {
            let Value::Object(m) = v else {
                return Err("__metadata__ is not an object".into());
            };
            for (k, v) in m {
                let Value::String(s) = v else {
                    return Err(format!("__metadata__ value for {k:?} is not a string"));
                };
                header.metadata.insert(k, s);
            }
            continue;
        }
        let obj = v
            .as_object()
            .ok_or_else(|| format!("tensor {name:?}: entry is not an object"))?;
        let dtype = obj
            .get("dtype")
            .and_then(Value::as_str)
            .ok_or_else(|| format!("tensor {name:?}: missing dtype"))?
            .to_string();
        let shape = obj
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("tensor {name:?}: missing shape"))?
            .iter()
            .map(|d| d.as_u64())
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| format!("tensor {name:?}: shape is not a list of integers"))?;
        let offs = obj
            .get("data_offsets")
            .and_then(Value::as_array)
            .and_then(|a| {
                let v = a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>()?;
                <[u64; 2]>::try_from(v).ok()
            })
            .ok_or_else(|| format!("tensor {name:?}: data_offsets is not [begin, end]"))?;
        let bytes = tensor_bytes(&name, &dtype, &shape)?;
        if offs[1] < offs[0] || offs[1] - offs[0] != bytes {
            return Err(format!(
                "tensor {name:?}: {dtype} {shape:?} needs {bytes} bytes but data_offsets {offs:?} hold {}",
                offs[1].saturating_sub(offs[0])
            ));
        }
        header.tensors.push(HeaderTensor {
            name,
            dtype,
            shape,
            data_offsets: offs,
        });
    }
    header.tensors.sort_by(|a, b| {
        a.data_offsets
            .cmp(&b.data_offsets)
            .then(a.name.cmp(&b.name))
    });
    let mut end = 0u64;
    for t in &header.tensors {
        if t.data_offsets[0] != end {
            return Err(format!(
                "tensor {:?}: data starts at {} but the previous tensor ends at {end} (gap or overlap)",
                t.name, t.data_offsets[0]
            ));
        }
        end = t.data_offsets[1];
    }
    header.data_bytes = end;
    Ok(header)
}

/// Serializes a header the way the safetensors crate does: compact JSON, padded with spaces
/// to a multiple of 8 bytes. Returns the full prefix (length + header).
pub fn write_header(tensors: &[HeaderTensor], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert(
            "__metadata__".into(),
            Value::Object(
                metadata
                    .iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect(),
            ),
        );
    }
    for t in tensors {
        map.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": t.data_offsets}),
        );
    }
    let mut json = Value::Object(map).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ht(name: &str, dtype: &str, shape: &[u64], b: u64, e: u64) -> HeaderTensor {
        HeaderTensor {
            name: name.into(),
            dtype: dtype.into(),
            shape: shape.to_vec(),
            data_offsets: [b, e],
        }
    }

    #[test]
    fn written_header_parses_back_and_matches_safetensors_crate() {
        let tensors = vec![
            ht("a", "F32", &[2, 3], 0, 24),
            ht("b", "BF16", &[5], 24, 34),
        ];
        let mut md = BTreeMap::new();
        md.insert("k".to_string(), "v".to_string());
        let prefix = write_header(&tensors, &md);
        let n = header_len(prefix[..8].try_into().unwrap(), "f", prefix.len() as u64).unwrap();
        let h = parse_header(&prefix[8..8 + n as usize], "f").unwrap();
        assert_eq!(h.tensors, tensors);
        assert_eq!(h.metadata, md);
        assert_eq!(h.data_bytes, 34);
        let mut file = prefix.clone();
        file.extend(std::iter::repeat_n(0u8, 34));
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        assert_eq!(st.tensor("a").unwrap().shape(), &[2, 3]);
    }

    #[test]
    fn header_over_its_limit_is_rejected_before_reading() {
        let err = header_len(
            (HEADER_BYTES_MAX + 1).to_le_bytes(),
            "big.safetensors",
            u64::MAX,
        )
        .unwrap_err();
        assert!(err.to_string().contains("over the limit"), "{err}");
        assert!(err.to_string().contains("big.safetensors"), "{err}");
        let err = header_len(100u64.to_le_bytes(), "short", 50).unwrap_err();
        assert!(err.to_string().contains("does not fit"), "{err}");
    }

    #[test]
    fn shape_disagreeing_with_byte_count_is_rejected() {
        let h = br#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,15]}}"#;
        let err = parse_header(h, "f").unwrap_err().to_string();
        assert!(err.contains("needs 16 bytes"), "{err}");
    }

    #[test]
    fn gaps_overlaps_unknown_dtypes_and_garbage_are_rejected() {
        for (h, want) in [
            (
                &br#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}"#[..],
                "gap or overlap",
            ),
            (
                br#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#,
                "gap or overlap",
            ),
            (
                br#"{"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,2]}}"#,
                "unknown dtype",
            ),
            (b"[1,2]", "does not start"),
            (b"{\xff}", "UTF-8"),
            (
                br#"{"a":{"dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,2]}}"#,
                "overflows",
            ),
            (br#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,2]}}"#, "shape"),
        ] {
            let err = parse_header(h, "f").unwrap_err().to_string();
            assert!(err.contains(want), "{err} should contain {want}");
        }
    }
}
