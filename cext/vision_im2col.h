/* im2col / col2im of one channel, for cext/vision.pyx. In C for `restrict`: written in Cython
 * with memset / memcpy per output row, a LeNet or CIFAR-10 convolution (rows of 8-32 floats)
 * spent more time in the calls than in the copies (0.8-1.7 Gfloat/s); plain loops over rows
 * that the compiler knows do not alias vectorize without runtime checks.
 *
 * Column row (i, j) of channel c holds, for every output (oy, ox), the image value at
 * (oy * sh - ph + i * dh, ox * sw - pw + j * dw), 0 outside the image. ox in [lo, hi) is the
 * range whose column lies inside the image (the same for every row of one (i, j)).
 */
static inline void vi_valid_cols(int off, int s, int W, int ow, int* lo, int* hi) {
    int a = 0, b;
    if (off < 0) a = (-off + s - 1) / s;
    b = W - 1 - off < 0 ? 0 : (W - 1 - off) / s + 1;
    if (a > ow) a = ow;
    if (b > ow) b = ow;
    if (b < a) b = a;
    *lo = a;
    *hi = b;
}

static void vi_im2col_channel(const float* restrict plane, int H, int W, int oh, int ow,
                              int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw,
                              float* restrict col) {
    for (int i = 0; i < kh; i++) {
        for (int j = 0; j < kw; j++) {
            int off = j * dw - pw, lo, hi;
            vi_valid_cols(off, sw, W, ow, &lo, &hi);
            for (int oy = 0; oy < oh; oy++, col += ow) {
                int iy = oy * sh - ph + i * dh;
                if (iy < 0 || iy >= H) {
                    for (int ox = 0; ox < ow; ox++) col[ox] = 0.f;
                    continue;
                }
                const float* restrict src = plane + (long)iy * W + off + lo * sw;
                float* restrict dst = col + lo;
                for (int ox = 0; ox < lo; ox++) col[ox] = 0.f;
                if (sw == 1)
                    for (int k = 0; k < hi - lo; k++) dst[k] = src[k];
                else
                    for (int k = 0; k < hi - lo; k++) dst[k] = src[k * sw];
                for (int ox = hi; ox < ow; ox++) col[ox] = 0.f;
            }
        }
    }
}

/* plane = the sum of the channel's columns back onto the image (zeroed first). */
static void vi_col2im_channel(const float* restrict col, int H, int W, int oh, int ow,
                              int kh, int kw, int ph, int pw, int sh, int sw, int dh, int dw,
                              float* restrict plane) {
    for (long p = 0; p < (long)H * W; p++) plane[p] = 0.f;
    for (int i = 0; i < kh; i++) {
        for (int j = 0; j < kw; j++) {
            int off = j * dw - pw, lo, hi;
            vi_valid_cols(off, sw, W, ow, &lo, &hi);
            for (int oy = 0; oy < oh; oy++, col += ow) {
                int iy = oy * sh - ph + i * dh;
                if (iy < 0 || iy >= H) continue;
                float* restrict dst = plane + (long)iy * W + off + lo * sw;
                const float* restrict src = col + lo;
                if (sw == 1)
                    for (int k = 0; k < hi - lo; k++) dst[k] += src[k];
                else
                    for (int k = 0; k < hi - lo; k++) dst[k * sw] += src[k];
            }
        }
    }
}
