//! Element-wise reduction kernels: `dst[i] = op(dst[i], src[i])` on raw bytes
//! of a known dtype. bool follows NCCL (SUM/MAX = OR, PRODUCT/MIN = AND) so the
//! stored bytes stay 0 or 1.
//!
//! Buffers need not be aligned for their dtype: torch lets a user make a
//! float32 view at any byte offset (`torch.frombuffer(..., offset=2)`).
//! Aligned ones are used in place; others go through aligned copies a block
//! at a time (`through_aligned`).

// Every public kernel here is a safe function whose unsafe code relies on
// invariants documented where it is.
#![deny(clippy::undocumented_unsafe_blocks)]

use crate::dtype::{DType, ReduceOp};
use half::{bf16, f16, slice::HalfFloatSliceExt};

/// Reinterpret a byte slice as `T`. Callers pass buffers aligned for `T`
/// (`through_aligned` sees to it), of whole elements.
fn typed<T>(bytes: &[u8]) -> &[T] {
    if bytes.is_empty() {
        return &[]; // an empty buffer's pointer may be anything
    }
    assert!((bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()), "misaligned buffer");
    assert!(bytes.len().is_multiple_of(std::mem::size_of::<T>()), "partial element");
    // SAFETY: the pointer is non-null and aligned for T (asserted), the
    // length is whole elements inside the slice, and the kernels' T are
    // plain numbers for which every bit pattern is a value.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / std::mem::size_of::<T>()) }
}

fn typed_mut<T>(bytes: &mut [u8]) -> &mut [T] {
    if bytes.is_empty() {
        return &mut [];
    }
    assert!((bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()), "misaligned buffer");
    assert!(bytes.len().is_multiple_of(std::mem::size_of::<T>()), "partial element");
    // SAFETY: as in `typed`; the slice is borrowed mutably, so the view is
    // the only access to these bytes while it lives.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut T, bytes.len() / std::mem::size_of::<T>()) }
}

/// Bytes a misaligned buffer is copied through at a time (a multiple of every element size).
const BOUNCE_BYTES: usize = 4096;

/// Run `kernel(dst, src)` (`src` may be empty: a kernel of `dst` alone) on
/// buffers aligned for `dtype`: these themselves where they are, else
/// aligned copies of a block of each at a time, `dst`'s copied back.
fn through_aligned(dtype: DType, dst: &mut [u8], src: &[u8], kernel: impl Fn(&mut [u8], &[u8])) {
    let aligned = |p: *const u8| (p as usize).is_multiple_of(dtype.size());
    if aligned(dst.as_ptr()) && (src.is_empty() || aligned(src.as_ptr())) {
        return kernel(dst, src);
    }
    let (mut a, mut b) = ([0u64; BOUNCE_BYTES / 8], [0u64; BOUNCE_BYTES / 8]);
    let (a, b) = (bytes_of_words(&mut a), bytes_of_words(&mut b));
    for (i, d) in dst.chunks_mut(BOUNCE_BYTES).enumerate() {
        let n = d.len();
        a[..n].copy_from_slice(d);
        let s = if src.is_empty() { &[][..] } else { &src[i * BOUNCE_BYTES..i * BOUNCE_BYTES + n] };
        b[..s.len()].copy_from_slice(s);
        kernel(&mut a[..n], &b[..s.len()]);
        d.copy_from_slice(&a[..n]);
    }
}

/// 8-byte aligned words viewed as bytes (scratch memory, bounce buffers).
pub fn bytes_of_words(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: u8 has no alignment, the byte length is that of the words,
    // and the words are borrowed mutably for as long as the bytes.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), std::mem::size_of_val(words)) }
}

#[inline(always)]
fn zip_apply<T: Copy>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    let d = typed_mut::<T>(dst);
    let s = typed::<T>(src);
    for (a, b) in d.iter_mut().zip(s) {
        *a = f(*a, *b);
    }
}

/// NaN-propagating min/max, as torch.min/torch.max do.
#[inline(always)]
fn fmin<T: PartialOrd + Copy>(a: T, b: T) -> T {
    #[allow(clippy::eq_op)]
    if a != a {
        a
    } else if b != b || b < a {
        b
    } else {
        a
    }
}

#[inline(always)]
fn fmax<T: PartialOrd + Copy>(a: T, b: T) -> T {
    #[allow(clippy::eq_op)]
    if a != a {
        a
    } else if b != b || b > a {
        b
    } else {
        a
    }
}

macro_rules! float_kernel {
    ($t:ty, $op:expr, $dst:expr, $src:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => zip_apply::<$t>($dst, $src, |a, b| a + b),
            ReduceOp::Product => zip_apply::<$t>($dst, $src, |a, b| a * b),
            ReduceOp::Min => zip_apply::<$t>($dst, $src, fmin),
            ReduceOp::Max => zip_apply::<$t>($dst, $src, fmax),
            _ => unreachable!("checked by ReduceOp::check"),
        }
    };
}

/// Half types widen a block at a time to f32 (SIMD conversions where the CPU
/// has them), combine there, and round once per element, like torch's CPU kernels.
#[inline(always)]
fn half_blocks<E>(dst: &mut [u8], src: &[u8], f: impl Fn(f32, f32) -> f32)
where
    [E]: HalfFloatSliceExt,
{
    const BLOCK: usize = 256;
    let d = typed_mut::<E>(dst);
    let s = typed::<E>(src);
    let (mut a, mut b) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (dc, sc) in d.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
        let n = dc.len();
        dc.convert_to_f32_slice(&mut a[..n]);
        sc.convert_to_f32_slice(&mut b[..n]);
        for (x, y) in a[..n].iter_mut().zip(&b[..n]) {
            *x = f(*x, *y);
        }
        dc.convert_from_f32_slice(&a[..n]);
    }
}

/// bfloat16 is the top half of an f32: widening is a shift, and narrowing
/// rounds to nearest even with integer arithmetic, both of which the compiler
/// vectorises (the `half` crate's per-element conversions do not).
#[inline(always)]
fn bf16_blocks(dst: &mut [u8], src: &[u8], f: impl Fn(f32, f32) -> f32) {
    const BLOCK: usize = 256;
    let d = typed_mut::<u16>(dst);
    let s = typed::<u16>(src);
    let mut a = [0f32; BLOCK];
    for (dc, sc) in d.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
        let n = dc.len();
        for ((x, &p), &q) in a[..n].iter_mut().zip(dc.iter()).zip(sc) {
            *x = f(f32::from_bits(u32::from(p) << 16), f32::from_bits(u32::from(q) << 16));
        }
        for (out, x) in dc.iter_mut().zip(&a[..n]) {
            *out = bf16_bits(*x);
        }
    }
}

/// `bf16::from_f32(x).to_bits()`, branch-free: round to nearest even, NaN stays (quiet) NaN.
#[inline(always)]
fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b & 0x7FFF_FFFF) > 0x7F80_0000;
    (if nan { (b >> 16) | 0x0040 } else { rounded }) as u16
}

macro_rules! half_kernel {
    ($t:ty, $op:expr, $dst:expr, $src:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => half_blocks::<$t>($dst, $src, |x, y| x + y),
            ReduceOp::Product => half_blocks::<$t>($dst, $src, |x, y| x * y),
            ReduceOp::Min => half_blocks::<$t>($dst, $src, fmin),
            ReduceOp::Max => half_blocks::<$t>($dst, $src, fmax),
            _ => unreachable!("checked by ReduceOp::check"),
        }
    };
}

macro_rules! int_kernel {
    ($t:ty, $op:expr, $dst:expr, $src:expr) => {
        match $op {
            ReduceOp::Sum => zip_apply::<$t>($dst, $src, |a, b| a.wrapping_add(b)),
            ReduceOp::Product => zip_apply::<$t>($dst, $src, |a, b| a.wrapping_mul(b)),
            ReduceOp::Min => zip_apply::<$t>($dst, $src, |a, b| a.min(b)),
            ReduceOp::Max => zip_apply::<$t>($dst, $src, |a, b| a.max(b)),
            ReduceOp::BAnd => zip_apply::<$t>($dst, $src, |a, b| a & b),
            ReduceOp::BOr => zip_apply::<$t>($dst, $src, |a, b| a | b),
            ReduceOp::BXor => zip_apply::<$t>($dst, $src, |a, b| a ^ b),
            ReduceOp::Avg => unreachable!("checked by ReduceOp::check"),
        }
    };
}

/// `dst = op(dst, src)` element-wise. `op` must have passed `ReduceOp::check`.
///
/// The kernels are compiled twice: for the baseline CPU the crate targets,
/// and with AVX2/F16C, chosen at run time. Results are identical (element-wise
/// IEEE operations, no fused multiply-add), so ranks on different CPUs agree.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "reduce_into: length mismatch");
    through_aligned(dtype, dst, src, |dst, src| reduce_aligned(dtype, op, dst, src))
}

fn reduce_aligned(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has the features the function is compiled for.
        return unsafe { reduce_into_avx2(dtype, op, dst, src) };
    }
    reduce_into_any_cpu(dtype, op, dst, src)
}

/// `reduce_into_any_cpu` compiled for AVX2 and F16C.
///
/// # Safety
/// The CPU must have AVX2 and F16C (`is_x86_feature_detected!`): the code
/// is compiled to use them.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_into_avx2(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    reduce_into_any_cpu(dtype, op, dst, src)
}

#[inline(always)]
fn reduce_into_any_cpu(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    match dtype {
        DType::F32 => float_kernel!(f32, op, dst, src),
        DType::F64 => float_kernel!(f64, op, dst, src),
        DType::F16 => half_kernel!(f16, op, dst, src),
        DType::BF16 => match op {
            ReduceOp::Sum | ReduceOp::Avg => bf16_blocks(dst, src, |x, y| x + y),
            ReduceOp::Product => bf16_blocks(dst, src, |x, y| x * y),
            ReduceOp::Min => bf16_blocks(dst, src, fmin),
            ReduceOp::Max => bf16_blocks(dst, src, fmax),
            _ => unreachable!("checked by ReduceOp::check"),
        },
        DType::I8 => int_kernel!(i8, op, dst, src),
        DType::U8 => int_kernel!(u8, op, dst, src),
        DType::I16 => int_kernel!(i16, op, dst, src),
        DType::I32 => int_kernel!(i32, op, dst, src),
        DType::I64 => int_kernel!(i64, op, dst, src),
        DType::U16 => int_kernel!(u16, op, dst, src),
        DType::U32 => int_kernel!(u32, op, dst, src),
        DType::U64 => int_kernel!(u64, op, dst, src),
        DType::Bool => match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr => zip_apply::<u8>(dst, src, |a, b| a | b),
            ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd => zip_apply::<u8>(dst, src, |a, b| a & b),
            ReduceOp::BXor => zip_apply::<u8>(dst, src, |a, b| a ^ b),
            ReduceOp::Avg => unreachable!("checked by ReduceOp::check"),
        },
    }
}

/// The last step of AVG: divide the fully reduced sum by the world size.
pub fn divide_by(dtype: DType, buf: &mut [u8], world: usize) {
    through_aligned(dtype, buf, &[], |buf, _| divide_aligned(dtype, buf, world))
}

fn divide_aligned(dtype: DType, buf: &mut [u8], world: usize) {
    let w = world as f64;
    match dtype {
        DType::F32 => typed_mut::<f32>(buf).iter_mut().for_each(|x| *x /= w as f32),
        DType::F64 => typed_mut::<f64>(buf).iter_mut().for_each(|x| *x /= w),
        DType::F16 => typed_mut::<f16>(buf).iter_mut().for_each(|x| *x = f16::from_f32(x.to_f32() / w as f32)),
        DType::BF16 => typed_mut::<bf16>(buf).iter_mut().for_each(|x| *x = bf16::from_f32(x.to_f32() / w as f32)),
        _ => unreachable!("AVG is float-only, checked by ReduceOp::check"),
    }
}

/// PREMUL_SUM's first step: multiply every element by `factor`.
pub fn scale(dtype: DType, buf: &mut [u8], factor: f64) {
    through_aligned(dtype, buf, &[], |buf, _| scale_aligned(dtype, buf, factor))
}

fn scale_aligned(dtype: DType, buf: &mut [u8], factor: f64) {
    match dtype {
        DType::F32 => typed_mut::<f32>(buf).iter_mut().for_each(|x| *x *= factor as f32),
        DType::F64 => typed_mut::<f64>(buf).iter_mut().for_each(|x| *x *= factor),
        DType::F16 => typed_mut::<f16>(buf).iter_mut().for_each(|x| *x = f16::from_f32(x.to_f32() * factor as f32)),
        DType::BF16 => typed_mut::<bf16>(buf).iter_mut().for_each(|x| *x = bf16::from_f32(x.to_f32() * factor as f32)),
        _ => unreachable!("PREMUL_SUM is float-only, checked by Reduction::check"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reduce two typed vectors through the byte kernel (Vec<T> is T-aligned).
    fn run<T: Copy + Default>(dtype: DType, op: ReduceOp, a: &[T], b: &[T]) -> Vec<T> {
        let mut da: Vec<T> = a.to_vec();
        let db: Vec<T> = b.to_vec();
        // SAFETY: byte views of whole vectors of plain numbers, each borrowed for the views' lifetime.
        let dst = unsafe { std::slice::from_raw_parts_mut(da.as_mut_ptr() as *mut u8, std::mem::size_of_val(a)) };
        // SAFETY: as above.
        let src = unsafe { std::slice::from_raw_parts(db.as_ptr() as *const u8, std::mem::size_of_val(b)) };
        reduce_into(dtype, op, dst, src);
        da
    }

    /// The same reduction on copies of `a` and `b` placed at every byte
    /// offset 0..8 (misaligned for every dtype wider than a byte).
    fn at_every_offset(dtype: DType, op: ReduceOp, a: &[u8], b: &[u8]) {
        let mut want = a.to_vec();
        through_aligned(dtype, &mut want, b, |d, s| reduce_aligned(dtype, op, d, s));
        for (da, db) in (0..8).flat_map(|x| (0..8).map(move |y| (x, y))) {
            let (mut ba, mut bb) = (vec![0u8; a.len() + 8], vec![0u8; b.len() + 8]);
            ba[da..da + a.len()].copy_from_slice(a);
            bb[db..db + b.len()].copy_from_slice(b);
            reduce_into(dtype, op, &mut ba[da..da + a.len()], &bb[db..db + b.len()]);
            assert_eq!(&ba[da..da + a.len()], &want[..], "{dtype:?} {op:?} at offsets {da}, {db}");
        }
    }

    #[test]
    fn misaligned_buffers_reduce_like_aligned_ones() {
        // Longer than one bounce block, and not a whole number of them.
        let n = BOUNCE_BYTES * 2 + 24;
        let a: Vec<u8> = (0..n).map(|i| (i * 7 % 251) as u8 & 0x3f).collect();
        let b: Vec<u8> = (0..n).map(|i| (i * 13 % 241) as u8 & 0x3f).collect();
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I16, DType::I32, DType::I64] {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                at_every_offset(dtype, op, &a, &b);
            }
        }
        let mut buf = [0u8; 4 * 5 + 2];
        let floats: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0, 5.0].iter().flat_map(|x| x.to_ne_bytes()).collect();
        buf[2..].copy_from_slice(&floats);
        scale(DType::F32, &mut buf[2..], 2.0);
        divide_by(DType::F32, &mut buf[2..], 4);
        let got: Vec<f32> = buf[2..].chunks(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, vec![0.5, 1.0, 1.5, 2.0, 2.5]);
    }

    #[test]
    fn float_ops() {
        let a = [1.0f32, -2.0, 3.5, f32::NAN];
        let b = [2.0f32, 5.0, -1.0, 0.0];
        assert_eq!(run(DType::F32, ReduceOp::Sum, &a[..3], &b[..3]), vec![3.0, 3.0, 2.5]);
        assert_eq!(run(DType::F32, ReduceOp::Product, &a[..3], &b[..3]), vec![2.0, -10.0, -3.5]);
        assert_eq!(run(DType::F32, ReduceOp::Min, &a[..3], &b[..3]), vec![1.0, -2.0, -1.0]);
        assert_eq!(run(DType::F32, ReduceOp::Max, &a[..3], &b[..3]), vec![2.0, 5.0, 3.5]);
        assert!(run(DType::F32, ReduceOp::Max, &a, &b)[3].is_nan(), "NaN propagates like torch.max");
        assert!(run(DType::F32, ReduceOp::Min, &b, &a)[3].is_nan(), "NaN propagates like torch.min");
        let d = run(DType::F64, ReduceOp::Sum, &[1.5f64, 2.0], &[0.25, -4.0]);
        assert_eq!(d, vec![1.75, -2.0]);
    }

    #[test]
    fn half_ops() {
        let a: Vec<f16> = [1.0f32, 2.0, -3.0].iter().map(|&x| f16::from_f32(x)).collect();
        let b: Vec<f16> = [0.5f32, 4.0, 1.0].iter().map(|&x| f16::from_f32(x)).collect();
        let s: Vec<f32> = run(DType::F16, ReduceOp::Sum, &a, &b).iter().map(|x| x.to_f32()).collect();
        assert_eq!(s, vec![1.5, 6.0, -2.0]);
        let a: Vec<bf16> = [1.0f32, 2.0, -3.0].iter().map(|&x| bf16::from_f32(x)).collect();
        let b: Vec<bf16> = [0.5f32, 4.0, 1.0].iter().map(|&x| bf16::from_f32(x)).collect();
        let m: Vec<f32> = run(DType::BF16, ReduceOp::Min, &a, &b).iter().map(|x| x.to_f32()).collect();
        assert_eq!(m, vec![0.5, 2.0, -3.0]);
        let p: Vec<f32> = run(DType::BF16, ReduceOp::Product, &a, &b).iter().map(|x| x.to_f32()).collect();
        assert_eq!(p, vec![0.5, 8.0, -3.0]);
    }

    #[test]
    fn bf16_narrowing_matches_the_half_crate_everywhere() {
        // Every rounding case lives in the low 16 bits and the exponent: sweep them all.
        for hi in (0..=0xFFFFu32).step_by(7).chain([0x7F7F, 0x7F80, 0x7FC0, 0xFF80, 0xFFFF, 0x0000, 0x8000]) {
            for lo in [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4000, 0xC000] {
                let x = f32::from_bits(hi << 16 | lo);
                assert_eq!(bf16_bits(x), bf16::from_f32(x).to_bits(), "{:#x}", hi << 16 | lo);
            }
        }
    }

    #[test]
    fn half_blocks_match_elementwise_rounding() {
        // Crosses block boundaries; each result is rounded once, from f32.
        let a: Vec<bf16> = (0..1000).map(|i| bf16::from_f32(i as f32 * 0.37 - 100.0)).collect();
        let b: Vec<bf16> = (0..1000).map(|i| bf16::from_f32((i % 17) as f32 * 1.3)).collect();
        let want: Vec<bf16> = a.iter().zip(&b).map(|(x, y)| bf16::from_f32(x.to_f32() + y.to_f32())).collect();
        assert_eq!(run(DType::BF16, ReduceOp::Sum, &a, &b), want);
        let a: Vec<f16> = a.iter().map(|x| f16::from_f32(x.to_f32())).collect();
        let b: Vec<f16> = b.iter().map(|x| f16::from_f32(x.to_f32())).collect();
        let want: Vec<f16> = a.iter().zip(&b).map(|(x, y)| f16::from_f32(x.to_f32().max(y.to_f32()))).collect();
        assert_eq!(run(DType::F16, ReduceOp::Max, &a, &b), want);
    }

    #[test]
    #[ignore = "timing probe: cargo test --release --lib -- --ignored kernel_speed --nocapture"]
    fn kernel_speed() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let n = 16 << 20;
            let mut a = vec![0u64; n / 8];
            let b = vec![0u64; n / 8];
            // SAFETY: byte views of the n bytes of two vectors of words, each borrowed for the views' lifetime.
            let (dst, src) = unsafe {
                (
                    std::slice::from_raw_parts_mut(a.as_mut_ptr() as *mut u8, n),
                    std::slice::from_raw_parts(b.as_ptr() as *const u8, n),
                )
            };
            let t0 = std::time::Instant::now();
            for _ in 0..10 {
                reduce_into(dtype, ReduceOp::Sum, dst, src);
            }
            eprintln!("{dtype:?}: {:.2} GB/s", 10.0 * n as f64 / t0.elapsed().as_secs_f64() / 1e9);
        }
    }

    #[test]
    fn int_ops_wrap_like_torch() {
        assert_eq!(run(DType::I8, ReduceOp::Sum, &[127i8, -128], &[1, -1]), vec![-128, 127]);
        assert_eq!(run(DType::U8, ReduceOp::Product, &[16u8, 3], &[16, 5]), vec![0, 15]);
        assert_eq!(run(DType::I16, ReduceOp::Min, &[5i16, -7], &[3, 9]), vec![3, -7]);
        assert_eq!(run(DType::I32, ReduceOp::Max, &[5i32, -7], &[3, 9]), vec![5, 9]);
        assert_eq!(run(DType::I64, ReduceOp::BAnd, &[0b1100i64], &[0b1010]), vec![0b1000]);
        assert_eq!(run(DType::I64, ReduceOp::BOr, &[0b1100i64], &[0b1010]), vec![0b1110]);
        assert_eq!(run(DType::I64, ReduceOp::BXor, &[0b1100i64], &[0b1010]), vec![0b0110]);
    }

    /// Wide unsigned types compare as unsigned: the top bit is the largest, not a sign.
    #[test]
    fn wide_unsigned_ops_wrap_and_compare_unsigned() {
        assert_eq!(run(DType::U16, ReduceOp::Sum, &[65535u16, 2], &[1, 3]), vec![0, 5]);
        assert_eq!(run(DType::U32, ReduceOp::Max, &[1u32 << 31, 7], &[1, 9]), vec![1 << 31, 9]);
        assert_eq!(run(DType::U64, ReduceOp::Min, &[1u64 << 63, 7], &[1, 9]), vec![1, 7]);
        assert_eq!(run(DType::U64, ReduceOp::Product, &[1u64 << 32, 3], &[1 << 32, 5]), vec![0, 15]);
        assert_eq!(run(DType::U32, ReduceOp::BXor, &[0b1100u32], &[0b1010]), vec![0b0110]);
        assert!(ReduceOp::Avg.check(DType::U64).is_err(), "an integer AVG has no integer result");
    }

    #[test]
    fn bool_stays_bool() {
        let a = [0u8, 1, 1, 0];
        let b = [0u8, 0, 1, 1];
        assert_eq!(run(DType::Bool, ReduceOp::Sum, &a, &b), vec![0, 1, 1, 1]);
        assert_eq!(run(DType::Bool, ReduceOp::Max, &a, &b), vec![0, 1, 1, 1]);
        assert_eq!(run(DType::Bool, ReduceOp::Product, &a, &b), vec![0, 0, 1, 0]);
        assert_eq!(run(DType::Bool, ReduceOp::Min, &a, &b), vec![0, 0, 1, 0]);
        assert_eq!(run(DType::Bool, ReduceOp::BXor, &a, &b), vec![0, 1, 0, 1]);
    }

    #[test]
    fn avg_divides() {
        let mut v = vec![3.0f32, 9.0];
        // SAFETY: the 8 bytes of two f32s, borrowed for the view's lifetime.
        let buf = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, 8) };
        divide_by(DType::F32, buf, 3);
        assert_eq!(v, vec![1.0, 3.0]);
    }

    #[test]
    fn op_dtype_checks() {
        assert!(ReduceOp::Avg.check(DType::I32).is_err());
        assert!(ReduceOp::Avg.check(DType::BF16).is_ok());
        assert!(ReduceOp::BXor.check(DType::F32).is_err());
        assert!(ReduceOp::BXor.check(DType::Bool).is_ok());
        let msg = ReduceOp::BAnd.check(DType::F16).unwrap_err().message;
        assert!(msg.contains("rustc10d") && msg.contains("BAND") && msg.contains("float16"), "{msg}");
        assert!(ReduceOp::from_code(8).unwrap_err().message.contains("PREMUL_SUM"));
    }
}
