/*
 * A PVH image written only from the PVH boot ABI (not ferry's guest): entered in 32-bit
 * protected mode with paging off and %ebx = hvm_start_info, it prints the start_info magic
 * and every memory map entry on COM1, then halts.
 */
    .section .note.pvh, "a"
    .align 4
    .long 4, 4, 18          /* name size, desc size, XEN_ELFNOTE_PHYS32_ENTRY */
    .asciz "Xen"
    .long entry

    .text
    .code32
    .globl entry
entry:
    cli
    movl $stack_top, %esp           /* the PVH ABI gives no stack */
    movl %ebx, %ebp                 /* start_info */
    movl $msg_magic, %esi
    call puts
    movl 0(%ebp), %eax              /* magic */
    call puthex32
    movl $msg_nl, %esi
    call puts
    movl 48(%ebp), %ecx             /* memmap_entries */
    movl 40(%ebp), %edi             /* memmap_paddr (low 32 bits) */
1:  testl %ecx, %ecx
    jz 2f
    pushl %ecx
    movl $msg_entry, %esi
    call puts
    movl 4(%edi), %eax              /* addr high */
    call puthex32
    movl 0(%edi), %eax              /* addr low */
    call puthex32
    movl $msg_size, %esi
    call puts
    movl 12(%edi), %eax             /* size high */
    call puthex32
    movl 8(%edi), %eax              /* size low */
    call puthex32
    movl $msg_type, %esi
    call puts
    movl 16(%edi), %eax             /* type */
    call puthex32
    movl $msg_nl, %esi
    call puts
    addl $24, %edi
    popl %ecx
    decl %ecx
    jmp 1b
2:  movl $msg_done, %esi
    call puts
3:  hlt
    jmp 3b

/* Writes %al to COM1 once the transmitter is empty. */
putc:
    pushl %eax
    movw $0x3fd, %dx
4:  inb %dx, %al
    testb $0x20, %al
    jz 4b
    popl %eax
    movw $0x3f8, %dx
    outb %al, %dx
    ret

/* Writes the NUL-terminated string at %esi. */
puts:
    lodsb
    testb %al, %al
    jz 5f
    call putc
    jmp puts
5:  ret

/* Writes %eax as 8 hex digits. */
puthex32:
    pushl %ecx
    movl %eax, %ebx
    movl $8, %ecx
6:  roll $4, %ebx
    movl %ebx, %eax
    andl $0xf, %eax
    movb hexdigits(%eax), %al
    call putc
    decl %ecx
    jnz 6b
    popl %ecx
    ret

    .section .rodata
hexdigits: .ascii "0123456789abcdef"
msg_magic: .asciz "pvh-minimal: magic=0x"
msg_entry: .asciz "pvh-minimal: memmap addr=0x"
msg_size:  .asciz " size=0x"
msg_type:  .asciz " type=0x"
msg_done:  .asciz "pvh-minimal: done\n"
msg_nl:    .asciz "\n"

    .section .bss
    .align 16
    .skip 4096
stack_top:
