/* Decode only the rows and columns of a JPEG that hold a box, with libjpeg-turbo's
 * jpeg_skip_scanlines and jpeg_crop_scanline (libjpeg-turbo >= 1.5; TurboJPEG 3's
 * tj3SetCroppingRegion does the same). Built and loaded by benchmarks/crop_decode.py,
 * through ctypes; not part of remote_loader. */
#include <setjmp.h>
#include <stdio.h>
#include <string.h>
#include <jpeglib.h>

struct failure {
    struct jpeg_error_mgr mgr;
    jmp_buf jump;
};

static void fail(j_common_ptr cinfo) {
    longjmp(((struct failure *)cinfo->err)->jump, 1);
}

static void quiet(j_common_ptr cinfo, int level) {
    (void)cinfo;
    (void)level;
}

/* Decode rows [top, bottom) and at least columns [left, right) of the image at 1/denom
 * scale into pixels (RGB, rows of (right - left + 2 iMCU widths) * 3 bytes at most, given as
 * stride). Returns the first decoded column (left, rounded down to an iMCU boundary) in
 * *first and the decoded width in *width; 0 on success. */
int decode_region(const unsigned char *data, unsigned long size, int denom, int fast,
                  int left, int top, int right, int bottom, unsigned char *pixels, int stride,
                  int *first, int *width) {
    struct jpeg_decompress_struct cinfo;
    struct failure err;
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = fail;
    err.mgr.emit_message = quiet;
    if (setjmp(err.jump)) {
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = denom;
    cinfo.dct_method = fast ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = fast ? FALSE : TRUE;
    jpeg_start_decompress(&cinfo);
    JDIMENSION x = left, w = right - left;
    jpeg_crop_scanline(&cinfo, &x, &w);
    if ((int)(w * 3) > stride) {
        jpeg_destroy_decompress(&cinfo);
        return -2;
    }
    if (top > 0 && jpeg_skip_scanlines(&cinfo, top) != (JDIMENSION)top) {
        jpeg_destroy_decompress(&cinfo);
        return -3;
    }
    for (int row = top; row < bottom; row++) {
        JSAMPROW line = pixels + (size_t)(row - top) * stride;
        if (jpeg_read_scanlines(&cinfo, &line, 1) != 1) {
            jpeg_destroy_decompress(&cinfo);
            return -4;
        }
    }
    *first = x;
    *width = w;
    jpeg_abort_decompress(&cinfo); /* rows below the box are never decoded */
    jpeg_destroy_decompress(&cinfo);
    return 0;
}
